"""The gpt recipe's text corpus (recipes/gpt/data.py), encoded with the model's tokenizer.

`tokenizer`: `bytes` (the byte-level vocabulary of 256, as the gpt recipe), or a directory holding
a `tokenizer.json` (by default the pretrained model's own directory), or that file itself; it is
read with the `tokenizers` library, never downloaded. The in-memory corpus is encoded whole when
the data is set up; `fw prepare task=hf_lm ...` encodes it into the prepared format with the same
tokenizer (the manifest names the tokenizer file's digest, so a dataset prepared with another one
is not taken for this one).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from framework.data.prepared import is_prepared
from framework.errors import ConfigError
from recipes.gpt.data import ByteBlocks, TextDataModule, stdlib_corpus

BYTES = "bytes"


def tokenizer_file(value: str) -> Path:
    """The tokenizer.json a `tokenizer` setting names (a directory or the file)."""
    path = Path(value).expanduser()
    return path / "tokenizer.json" if path.is_dir() else path


class TokenizerEncoder:
    """A text file as token ids (int32) with a tokenizer.json; picklable, for `fw prepare`'s
    worker processes (the tokenizer is loaded in the process that encodes)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._tokenizer = None

    def __call__(self, file: str) -> torch.Tensor:
        ids = self.encode(Path(file).read_text(encoding="utf-8", errors="replace"))
        return torch.tensor(ids, dtype=torch.int32)

    def encode(self, text: str) -> list[int]:
        if self._tokenizer is None:
            from tokenizers import Tokenizer

            self._tokenizer = Tokenizer.from_file(self.path)
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def __getstate__(self) -> dict:
        return {"path": self.path, "_tokenizer": None}


class HFTextDataModule(TextDataModule):
    """TextDataModule whose text is encoded with `tokenizer` (see the module docstring)."""

    def __init__(
        self,
        tokenizer: str | None = BYTES,
        path: str | None = None,
        block_size: int = 128,
        batch_size: int = 32,
        val_fraction: float = 0.05,
        max_bytes: int = 4_000_000,
        num_workers: int = 0,
        prepared: str | None = None,
        source: str | None = None,
        chunk_bytes: int = 16_000_000,
    ) -> None:
        super().__init__(
            path, block_size, batch_size, val_fraction, max_bytes, num_workers, prepared, source
        )
        self.chunk_bytes = chunk_bytes
        self.tokenizer_name = BYTES if tokenizer is None else str(tokenizer)

    @property
    def encoder(self) -> TokenizerEncoder | None:
        if self.tokenizer_name == BYTES:
            return None
        return TokenizerEncoder(str(tokenizer_file(self.tokenizer_name)))

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (its UTF-8 bytes with the byte-level vocabulary)."""
        encoder = self.encoder
        return list(text.encode()) if encoder is None else encoder.encode(text)

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer_name == BYTES:
            return bytes(ids).decode("utf-8", errors="replace")
        from tokenizers import Tokenizer

        return Tokenizer.from_file(self.encoder.path).decode(ids)

    @property
    def vocab_size(self) -> int:
        if self.encoder is None:
            return 256
        from tokenizers import Tokenizer

        return Tokenizer.from_file(self.encoder.path).get_vocab_size()

    @staticmethod
    def validate_config(prefix: str, args: dict) -> None:
        TextDataModule.validate_config(prefix, {k: v for k, v in args.items() if k != "tokenizer"})
        value = args.get("tokenizer", BYTES)
        if value in (None, BYTES):
            return
        if not tokenizer_file(str(value)).is_file():
            raise ConfigError(
                f"{prefix}.tokenizer",
                value,
                "holds no tokenizer.json (read with the tokenizers library; nothing is downloaded)",
                hint=f"Give a directory with tokenizer.json, the file itself, or "
                f"{prefix}.tokenizer=bytes for a byte-level vocabulary.",
            )

    def check_ready(self, prefix: str = "task.data") -> None:
        """Training on `prepared` needs it prepared (`fw train` calls this before launch)."""
        if self.prepared is not None and not is_prepared(Path(self.prepared)):
            raise ConfigError(
                f"{prefix}.prepared",
                self.prepared,
                "is not a prepared dataset (or its preparation did not finish)",
                hint=f"Run: fw prepare task=hf_lm {prefix}.prepared={self.prepared} "
                f"{prefix}.tokenizer={self.tokenizer_name} [{prefix}.source=DIR]",
            )

    def prepare(self, workers: int, engine: str = "local") -> bool:
        if self.encoder is None:
            return super().prepare(workers, engine)
        from framework.data.prepared import fingerprint, prepare, text_files

        if self.prepared is None:
            return super().prepare(workers, engine)  # its refusal
        if self.source is None:
            from recipes.gpt.data import stdlib_files

            files, source = stdlib_files(self.max_bytes), "the standard library's sources"
        else:
            files = text_files(Path(self.source), "task.data.source", self.max_bytes)
            source = str(Path(self.source).resolve())
        digest = hashlib.sha256(Path(self.encoder.path).read_bytes()).hexdigest()
        manifest = {"input": fingerprint(files), "source": source, "encoder": f"tokenizer:{digest}"}
        return prepare(
            [str(f) for f in files],
            self.encoder,
            Path(self.prepared),
            workers,
            manifest,
            "task.data.prepared",
            self.chunk_bytes,
            engine,
        )

    def record_tokenizer(self) -> None:
        """Rank 0 copies the tokenizer files into the run directory (`tokenizer/`), where
        `fw export --format hf` takes them from: an export copies nothing from outside the run
        directory."""
        from framework import files
        from framework.integrations.hf.export import TOKENIZER_DIR, TOKENIZER_FILES

        trainer = getattr(self, "trainer", None)
        if self.encoder is None or trainer is None or not trainer.is_global_zero:
            return
        given = Path(self.tokenizer_name).expanduser()
        found = [given / n for n in TOKENIZER_FILES] if given.is_dir() else [given]
        target = Path(trainer.default_root_dir) / TOKENIZER_DIR
        target.mkdir(exist_ok=True)
        for path in (f for f in found if f.is_file()):
            name = "tokenizer.json" if path == given else path.name
            files.write_atomic_with(target / name, lambda fh, p=path: fh.write(p.read_bytes()))

    def setup(self, stage: str | None = None) -> None:
        self.record_tokenizer()
        encoder = self.encoder
        if encoder is None or self.prepared is not None:
            return super().setup(stage)
        raw = (
            Path(self.path).read_bytes()[: self.max_bytes]
            if self.path
            else stdlib_corpus(self.max_bytes)
        )
        ids = encoder.encode(raw.decode("utf-8", errors="replace"))
        data = torch.tensor(ids, dtype=torch.int32)
        split = int(len(data) * (1 - self.val_fraction))
        self.train_set = ByteBlocks(data[:split], self.block_size)
        self.val_set = ByteBlocks(data[split:], self.block_size)
        if len(self.train_set) == 0 or len(self.val_set) == 0:
            raise ValueError(
                f"corpus of {len(data)} tokens is too small for block_size={self.block_size}"
            )
