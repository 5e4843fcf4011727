"""Bytes of a text corpus cut into blocks; the last `val_fraction` of the bytes is held out.

The default corpus is the Python standard library's own source files (present on every machine
with Python): read in sorted path order up to `max_bytes`, so it is the same everywhere.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import Dataset

from framework.data import make_loader
from framework.errors import ConfigError


def stdlib_corpus(max_bytes: int) -> bytes:
    """The standard library's .py files, concatenated in sorted order, up to max_bytes."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, size = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts:
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        size += len(data)
        if size >= max_bytes:
            break
    return b"".join(chunks)[:max_bytes]


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
    ) -> None:
        super().__init__()
        self.path = path
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
        for key in ("block_size", "batch_size", "max_bytes"):
            if key in args and args[key] < 1:
                raise ConfigError(f"{prefix}.{key}", args[key], "must be at least 1")
        if not 0.0 < args.get("val_fraction", 0.05) < 1.0:
            raise ConfigError(
                f"{prefix}.val_fraction", args["val_fraction"], "must be between 0 and 1"
            )

    def setup(self, stage: str | None = None) -> None:
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
