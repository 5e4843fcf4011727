"""Boxes of the tensors of a zip-format torch file, read with positional reads.

The file's pickle is loaded once with every tensor on the meta device (framework/checkpoint/
safe.py's `load_torch(meta=True)`: no data read); each meta tensor's storage records where its
bytes start in the file (`_checkpoint_offset`; torch stores storages uncompressed). A box of a
tensor is then read with `os.pread`, in pieces of at most `PIECE` bytes along its outermost
dimension, and copied into the caller's tensor: the process never holds more than one piece
beyond what it keeps. Not a memory map: the pages of a mapped file count in the process's
resident memory until it is unmapped, so reading a whole checkpoint through one would hold it.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch

PIECE = 64 << 20  # bytes read at once, at most (more only for one row of a wider tensor)


class TorchFile:
    """An open zip-format torch file whose tensors are meta tensors of its loaded pickle."""

    def __init__(self, path: Any) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDONLY)
        self.bytes_read = 0

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def read_box(
        self, saved: torch.Tensor, offset: tuple[int, ...], out: torch.Tensor, base: int = 0
    ) -> None:
        """Copy the box of meta tensor `saved` that starts at `offset` and has `out`'s shape
        into `out` (converting the dtype); `base`: where the torch file holding `saved` starts
        in this file (a saved chunk inside a DCP file)."""
        if out.numel() == 0:
            return
        offset = tuple(offset) or (0,) * saved.dim()
        size = tuple(out.shape)
        if saved.dim() == 0:
            self._copy_span(saved, (), (), out, base)
            return
        # pieces along the dimension of the largest stride (the outermost one when row-major)
        dim = max(range(saved.dim()), key=lambda d: (saved.stride(d), -d))
        step = max(1, PIECE // max(1, saved.stride(dim) * saved.element_size()))
        for start in range(0, size[dim], step):
            n = min(step, size[dim] - start)
            piece_offset = tuple(o + start if d == dim else o for d, o in enumerate(offset))
            piece_size = tuple(n if d == dim else s for d, s in enumerate(size))
            self._copy_span(saved, piece_offset, piece_size, out.narrow(dim, start, n), base)

    def _copy_span(self, saved: torch.Tensor, offset, size, out: torch.Tensor, base: int) -> None:
        """Read the bytes spanning one box of `saved` and copy the box into `out`."""
        strides = saved.stride()
        first = saved.storage_offset() + sum(o * s for o, s in zip(offset, strides, strict=True))
        span = 1 + sum((n - 1) * s for n, s in zip(size, strides, strict=True))
        item = saved.element_size()
        where = base + saved.untyped_storage()._checkpoint_offset
        # read straight into one writable buffer: os.pread's bytes copied into a bytearray held
        # each piece twice at once
        data = bytearray(span * item)
        if os.preadv(self.fd, [data], where + first * item) != len(data):
            raise ValueError(f"{self.path} is shorter than its tensors (truncated?)")
        self.bytes_read += len(data)
        flat = torch.frombuffer(data, dtype=saved.dtype)
        box = flat.as_strided(size, strides) if size else flat[0]
        out.copy_(box)


def spec_of(tensor: torch.Tensor):
    """The TensorSpec of a meta tensor."""
    from framework.checkpoint.portable import TensorSpec

    return TensorSpec(tuple(tensor.shape), tensor.dtype)


def largest_piece(model: dict, optimizers: list) -> int:
    """The most bytes a positional reader holds at once: one piece (at most PIECE, or one row of
    a wider tensor) of the largest tensor it reads."""
    from framework.checkpoint.portable import TensorSpec

    specs = list(model.values())
    specs += [v for o in optimizers for e in o.state.values() for v in e.values()]
    found = 0
    for spec in (s for s in specs if isinstance(s, TensorSpec) and s.numel):
        row = spec.nbytes // spec.shape[0] if spec.shape else spec.nbytes
        found = max(found, min(spec.nbytes, max(PIECE, row)))
    return found


def nbytes(tensor: torch.Tensor) -> int:
    return math.prod(tensor.shape) * tensor.element_size()
