"""Prepared datasets: a corpus encoded once, in parallel, into litdata's chunked format, and read
back as a map-style dataset so the framework's sampler keeps its guarantees.

`prepare(items, encode, output, workers)` runs `encode(item)` (a 1-D tensor of token ids) for
every item with `litdata.optimize` on `workers` processes, the items kept in their order: the
output is the items' token streams, one after the other, in chunk files plus an `index.json`.
A run that is killed keeps litdata's checkpoints; the same command again continues from them and
writes the same bytes as an uninterrupted run. The output holds `fw_prepared.json`, which names
what it was prepared from: a finished dataset is not prepared again, and a directory holding
another dataset (or anything else) is refused before any work.

`engine="ray"` writes the same bytes on Ray Data instead, on this machine or on a cluster (when
`RAY_ADDRESS` names one): the items are cut into `workers` consecutive parts as litdata's ordered
workers cut them, part k is encoded and written by a Ray task as litdata's worker k writes it
(`chunk-k-*.bin` and its own index), and the parts' indexes are joined in order into `index.json`.
A killed run, rerun, keeps the parts that finished and writes the others again
(framework/data/ray_engine.py).

`TokenBlocks(path, block)` reads the stream back as consecutive blocks of `block` tokens (a tail
shorter than a block, per chunk, is left out: packing without padding). It is a plain `Dataset`
with random access (`len`, `[i]` = block i of the whole dataset on every rank), so
`framework.data.make_loader`'s global order, exact mid-epoch resume and any process count hold
for it as for any in-memory dataset; litdata's own sharding and shuffling of its
`StreamingDataset` are not used.

litdata is the framework's format because it is written deterministically (ordered workers) and
resumes a killed preparation, while mosaicml-streaming's writer neither resumes nor imports in
this environment; see docs/data.md for the measurements.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from torch.utils.data import Dataset

from framework.checkpoint.disk import write_text_atomic
from framework.errors import ConfigError

MANIFEST = "fw_prepared.json"
ENGINES = ("local", "ray")
os.environ.setdefault("LITDATA_DISABLE_VERSION_CHECK", "1")  # no call to pypi.org per dataset


def fingerprint(items: Sequence[Path]) -> str:
    """What a preparation of files reads: their paths, sizes and modification times, in order
    (not their contents: reading hundreds of GB twice to compare would cost a preparation)."""
    digest = hashlib.sha256()
    for path in items:
        stat = Path(path).stat()
        digest.update(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def byte_tokens(path: str):
    """A file's bytes as token ids (uint8): the byte-level encoder of the gpt recipes."""
    import torch

    data = Path(path).read_bytes()
    if not data:  # an empty file (a package's __init__.py): no tokens
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def text_files(root: Path, key: str, max_bytes: int | None = None) -> list[Path]:
    """Every file under `root` in sorted order (up to `max_bytes` in all), checked to be
    readable and not all empty; ConfigError naming `key` otherwise."""
    if not root.is_dir():
        raise ConfigError(key, str(root), "is not a directory")
    files, size = [], 0
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        if not os.access(path, os.R_OK):
            raise ConfigError(key, str(root), f"holds an unreadable file: {path}")
        files.append(path)
        size += path.stat().st_size
        if max_bytes is not None and size >= max_bytes:
            break
    if size == 0:
        raise ConfigError(key, str(root), "holds no text (no files, or only empty ones)")
    return files


def check_output(output: Path, manifest: dict[str, Any], key: str) -> str:
    """'done' (prepared from the same input: nothing to do), 'resume' (a killed run of the same
    preparation) or 'new'; ConfigError when `output` holds anything else."""
    found = output / MANIFEST
    if found.is_file():
        old = json.loads(found.read_text())
        if old.get("input") != manifest["input"] or old.get("encoder") != manifest["encoder"]:
            raise ConfigError(
                key,
                str(output),
                f"holds a dataset prepared from other input ({old.get('source', '?')})",
                hint="Choose an empty or new directory, or delete that dataset first.",
            )
        if old.get("complete"):
            return "done"
        ran = {**old, "engine": old.get("engine", "local")}  # written before there were engines
        for name in ("workers", "chunk_bytes", "engine"):
            if ran.get(name) != manifest[name]:
                raise ConfigError(
                    name,
                    manifest[name],
                    f"the interrupted preparation in {output} ran with {ran.get('workers')} "
                    f"workers, chunks of {ran.get('chunk_bytes')} bytes and the "
                    f"{ran['engine']} engine; it continues only with the same",
                    [str(ran.get(name))],
                )
        return "resume"
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise ConfigError(
            key, str(output), "exists and is not an empty directory or a prepared dataset"
        )
    return "new"


def prepare(
    items: Sequence[Any],
    encode: Callable[[Any], Any],
    output: Path,
    workers: int,
    manifest: dict[str, Any],
    key: str = "output",
    chunk_bytes: int = 16_000_000,
    engine: str = "local",
) -> bool:
    """Encode `items` into `output` (see the module docstring); False when it was already done.
    `manifest` names the input (`input`: a fingerprint, `source`: for people, `encoder`).
    `engine`: "local" (litdata's workers on this machine) or "ray" (Ray Data tasks)."""
    if engine not in ENGINES:
        raise ConfigError("engine", engine, "is not a preparation engine", list(ENGINES))
    manifest = {
        **manifest,
        "workers": workers,
        "chunk_bytes": chunk_bytes,
        "engine": engine,
        "complete": False,
    }
    state = check_output(output, manifest, key)
    if state == "done":
        return False
    if engine == "ray" and importlib.util.find_spec("ray") is None:
        raise ConfigError(
            "engine",
            engine,
            "needs Ray Data, which is not installed",
            hint='Install it with: pip install -e ".[ray]" (make install does).',
        )
    existed = output.exists()
    output.mkdir(parents=True, exist_ok=True)
    (output / MANIFEST).write_text(json.dumps(manifest, indent=1))
    try:
        if engine == "ray":
            from framework.data.ray_engine import write_with_ray

            write_with_ray(list(items), encode, output, workers, chunk_bytes)
        else:
            write_with_litdata(list(items), encode, output, workers, chunk_bytes)
    except ConfigError:  # refused before any part was written (no Ray cluster to join)
        if state == "new":
            (output / MANIFEST).unlink()
            if not existed:
                output.rmdir()
        raise
    manifest["complete"] = True
    write_text_atomic(output / MANIFEST, json.dumps(manifest, indent=1))
    return True


def write_with_litdata(
    items: list[Any], encode: Callable, output: Path, workers: int, chunk_bytes: int
) -> None:
    """The local engine: `litdata.optimize` on `workers` processes of this machine."""
    import litdata

    litdata.optimize(
        fn=encode,
        inputs=items,
        output_dir=str(output),
        num_workers=workers,
        chunk_bytes=chunk_bytes,
        item_loader=litdata.TokensLoader(),
        reorder_files=False,
        keep_data_ordered=True,
        use_checkpoint=True,
        start_method="fork",
    )


def is_prepared(path: Path) -> bool:
    found = Path(path) / MANIFEST
    return found.is_file() and bool(json.loads(found.read_text()).get("complete"))


class TokenBlocks(Dataset):
    """Block i of `block` consecutive tokens of a prepared dataset, on any rank and worker."""

    def __init__(self, path: str | Path, block: int) -> None:
        self.path, self.block = str(path), block
        index = json.loads((Path(path) / "index.json").read_text())
        self.length = sum(int(chunk["dim"]) // block for chunk in index["chunks"])
        self._stream = None  # opened in the process that reads (DataLoader workers fork)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int):
        if self._stream is None:
            import litdata

            self._stream = litdata.StreamingDataset(
                self.path, item_loader=litdata.TokensLoader(block_size=self.block)
            )
        if not 0 <= i < self.length:
            raise IndexError(i)
        return self._stream[i]

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_stream": None}
