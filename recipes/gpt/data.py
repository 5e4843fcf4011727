"""Bytes of a text corpus cut into blocks; the last `val_fraction` is held out.

The default corpus is the Python standard library's own source files (present on every machine
with Python): read in sorted path order up to `max_bytes`, so it is the same everywhere.

Two ways to read it: whole into memory (`path`: one text file, or the standard library), or
prepared once by `fw prepare task=gpt task.data.prepared=DIR [task.data.source=DIR]` into a
chunked dataset (framework/data/prepared.py) that training then reads block by block
(`task.data.prepared=DIR`), for corpora that do not fit in memory.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import Dataset

from framework.data import make_loader
from framework.data.prepared import TokenBlocks, byte_tokens, fingerprint, is_prepared, text_files
from framework.errors import ConfigError


def stdlib_files(max_bytes: int) -> list[Path]:
    """The standard library's readable .py files in sorted path order (outside `test` and
    `site-packages`), until max_bytes are reached. The tree is walked in that order and only as
    far as needed: a sorted walk of the whole library took about 0.5 s per process."""
    files: list[Path] = []
    size = 0

    def walk(folder: Path) -> bool:  # True once enough bytes were found
        nonlocal size
        try:
            entries = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError:
            return False
        for entry in entries:
            path = Path(entry.path)
            if entry.is_dir(follow_symlinks=True) and not entry.is_symlink():
                if entry.name not in ("test", "site-packages") and walk(path):
                    return True
            elif entry.name.endswith(".py") and os.access(path, os.R_OK):
                files.append(path)
                size += path.stat().st_size
                if size >= max_bytes:
                    return True
        return False

    walk(Path(sysconfig.get_paths()["stdlib"]))
    return files


def stdlib_corpus(max_bytes: int) -> bytes:
    """The standard library's .py files, concatenated in sorted order, up to max_bytes."""
    return b"".join(p.read_bytes() for p in stdlib_files(max_bytes))[:max_bytes]


class ByteBlocks(Dataset):
    """Consecutive windows of block_size + 1 bytes (each shares its last byte with the next one):
    the input is the first block_size bytes, the target the same window shifted by one."""

    def __init__(self, data: torch.Tensor, block_size: int) -> None:
        self.data = data
        self.block_size = block_size

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.block_size

    def __getitem__(self, i: int):
        chunk = self.data[i * self.block_size : (i + 1) * self.block_size + 1].long()
        return chunk[:-1], chunk[1:]


class Shifted(Dataset):
    """Blocks `start`..`stop` of a prepared dataset as (input, target): a block of
    block_size + 1 tokens, the target shifted by one."""

    def __init__(self, blocks: TokenBlocks, start: int, stop: int) -> None:
        self.blocks, self.start, self.stop = blocks, start, stop

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, i: int):
        if not 0 <= i < len(self):
            raise IndexError(i)
        chunk = self.blocks[self.start + i].long()
        return chunk[:-1], chunk[1:]


def check_corpus_size(prefix: str, args: dict) -> None:
    """The corpus read into memory (`path`, or the standard library's sources) holds at least
    one block for training and one for validation: the bytes it reads are known before launch
    (the file's size, or max_bytes of the standard library, which is far larger)."""
    block = int(args.get("block_size", 128))
    limit = int(args.get("max_bytes", 4_000_000))
    path = args.get("path")
    size = min(Path(path).stat().st_size, limit) if path else limit
    split = int(size * (1 - float(args.get("val_fraction", 0.05))))
    if (split - 1) // block >= 1 and (size - split - 1) // block >= 1:
        return
    need = int((block + 1) / min(float(args.get("val_fraction", 0.05)), 0.5)) + block + 2
    key, value = (
        (f"{prefix}.path", path) if path and size < limit else (f"{prefix}.max_bytes", limit)
    )
    raise ConfigError(
        key,
        value,
        f"{size} bytes of text do not fill one block of {block + 1} bytes for training and one "
        "for validation",
        hint=f"Give at least about {need} bytes (task.data.max_bytes), or a smaller "
        "task.model.block_size.",
    )


PROMPTS = ("def main(", "class ", "import ")  # what `fw predict` continues by default


class TextDataModule(pl.LightningDataModule):
    """Byte-level language-modelling data from a text file (or the stdlib sources by default)."""

    def __init__(
        self,
        path: str | None = None,
        block_size: int = 128,
        batch_size: int = 32,
        val_fraction: float = 0.05,
        max_bytes: int = 4_000_000,
        num_workers: int = 0,
        prepared: str | None = None,
        source: str | None = None,
        chunk_bytes: int = 16_000_000,
        prompts: list[str] | None = None,
    ) -> None:
        super().__init__()
        self.prompts = list(prompts) if prompts is not None else list(PROMPTS)
        self.path = path
        self.prepared = prepared
        self.source = source
        self.chunk_bytes = chunk_bytes
        self.block_size = block_size
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.max_bytes = max_bytes
        self.num_workers = num_workers

    @staticmethod
    def validate_config(prefix: str, args: dict) -> None:
        path = args.get("path")
        if path is not None and not Path(path).is_file():
            raise ConfigError(
                f"{prefix}.path",
                path,
                "no such file",
                hint="Give a readable text file, or null for the standard library's sources.",
            )
        for key in ("block_size", "batch_size", "max_bytes", "chunk_bytes"):
            if key in args and args[key] < 1:
                raise ConfigError(f"{prefix}.{key}", args[key], "must be at least 1")
        if not 0.0 < args.get("val_fraction", 0.05) < 1.0:
            raise ConfigError(
                f"{prefix}.val_fraction", args["val_fraction"], "must be between 0 and 1"
            )
        if args.get("prepared") is None:
            check_corpus_size(prefix, args)
        if args.get("prepared") is not None and args.get("path") is not None:
            raise ConfigError(
                f"{prefix}.path",
                args["path"],
                "reads a file into memory; prepared data is read "
                "from task.data.prepared: give one of the two",
                ["null"],
            )

    def check_ready(self, prefix: str = "task.data") -> None:
        """Training on `prepared` needs it prepared (`fw train` calls this before launch)."""
        if self.prepared is not None and not is_prepared(Path(self.prepared)):
            raise ConfigError(
                f"{prefix}.prepared",
                self.prepared,
                "is not a prepared dataset (or its preparation did not finish)",
                hint=f"Run: fw prepare task=gpt {prefix}.prepared={self.prepared} "
                f"[{prefix}.source=DIR]",
            )

    def prepare(self, workers: int, engine: str = "local") -> bool:
        """`fw prepare`: the text files of `source` (or the standard library's sources, up to
        max_bytes) as byte tokens into `prepared`, on `engine` ("local" or "ray"); False when
        that was already done."""
        from framework.data.prepared import prepare

        if self.prepared is None:
            raise ConfigError(
                "task.data.prepared",
                None,
                "names the directory to prepare into",
                hint="fw prepare task=gpt task.data.prepared=DIR",
            )
        if self.source is None:
            files, source = stdlib_files(self.max_bytes), "the standard library's sources"
        else:
            files = text_files(Path(self.source), "task.data.source", self.max_bytes)
            source = str(Path(self.source).resolve())
        manifest = {"input": fingerprint(files), "source": source, "encoder": "bytes"}
        return prepare(
            [str(f) for f in files],
            byte_tokens,
            Path(self.prepared),
            workers,
            manifest,
            "task.data.prepared",
            self.chunk_bytes,
            engine,
        )

    def setup(self, stage: str | None = None) -> None:
        if stage == "predict":
            return  # the prompts are all it reads
        if self.prepared is not None:
            self.check_ready()
            blocks = TokenBlocks(self.prepared, self.block_size + 1)
            held_out = max(1, int(len(blocks) * self.val_fraction))
            split = len(blocks) - held_out
            if split < 1:
                raise ValueError(f"{self.prepared} holds too few blocks of {self.block_size + 1}")
            self.train_set = Shifted(blocks, 0, split)
            self.val_set = Shifted(blocks, split, len(blocks))
            return
        raw = (
            Path(self.path).read_bytes()[: self.max_bytes]
            if self.path
            else stdlib_corpus(self.max_bytes)
        )
        data = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        split = int(len(data) * (1 - self.val_fraction))
        self.train_set = ByteBlocks(data[:split], self.block_size)
        self.val_set = ByteBlocks(data[split:], self.block_size)
        if len(self.train_set) == 0 or len(self.val_set) == 0:
            raise ValueError(
                f"corpus of {len(data)} bytes is too small for block_size={self.block_size}"
            )

    def train_dataloader(self):
        return make_loader(
            self.train_set, self.batch_size, shuffle=True, num_workers=self.num_workers
        )

    def val_dataloader(self):
        return make_loader(
            self.val_set, self.batch_size, shuffle=False, num_workers=self.num_workers
        )

    def test_dataloader(self):
        """The held-out end of the corpus (the validation split)."""
        return self.val_dataloader()

    def predict_dataloader(self):
        """The prompts `fw predict` continues, one per batch (they differ in length)."""
        from torch.utils.data import DataLoader

        return DataLoader(self.prompts, batch_size=1, shuffle=False, collate_fn=list)
