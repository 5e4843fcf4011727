"""Tensors out of safetensors files, read with plain positional reads (an 8-byte header length,
a JSON header of dtype, shape and byte offsets, then the raw data), each process reading only
the box of a tensor it holds (a DTensor's local shard, a ZeRO partition's boxes, or the whole
tensor)."""

from __future__ import annotations

import itertools
import json
import math
import os
import struct
from pathlib import Path

import torch

INDEX = "model.safetensors.index.json"
DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def read_stacked_box(entry, parts: list[list[str]], shape, starts, sizes, out: torch.Tensor) -> int:
    """Read the box (starts, sizes) of a stacked expert tensor of `shape` (E, R, C) into `out`,
    from per-expert file tensors: expert e's rows are the parts' tensors of expert e,
    concatenated. Only the experts and rows of the box are read; returns the bytes read."""
    read = 0
    for e in range(starts[0], starts[0] + sizes[0]):
        offset = 0  # of the part's first row in the expert's rows
        for part in parts:
            fh, base, info = entry(part[e])
            rows, want = info["shape"][0], [shape[1], shape[2]]
            if len(info["shape"]) != 2 or info["shape"][1] != want[1]:
                raise RuntimeError(f"{part[e]}: shape {info['shape']} does not stack into {want}")
            lo = max(starts[1], offset)
            hi = min(starts[1] + sizes[1], offset + rows)
            if hi > lo and sizes[2] > 0:
                block = read_slice(
                    fh.fileno(),
                    base + info["data_offsets"][0],
                    DTYPES[info["dtype"]],
                    info["shape"],
                    [lo - offset, starts[2]],
                    [hi - lo, sizes[2]],
                )
                out[e - starts[0], lo - starts[1] : hi - starts[1]].copy_(block)
                read += block.numel() * block.element_size()
            offset += rows
        if offset != shape[1]:
            raise RuntimeError(f"{parts[0][e]}...: {offset} rows do not make {shape[1]}")
    return read


def weight_map(directory: Path) -> dict[str, str]:
    """{tensor name: file name} of a pretrained directory: its index when sharded, else the
    names in each *.safetensors file's header."""
    index = directory / INDEX
    if index.is_file():
        return dict(json.loads(index.read_text())["weight_map"])
    found: dict[str, str] = {}
    for path in sorted(directory.glob("*.safetensors")):
        with open(path, "rb") as fh:
            found.update({name: path.name for name in read_header(fh)[0]})
    return found


def read_header(fh) -> tuple[dict, int]:
    """(header without its metadata, offset of the data) of an open safetensors file."""
    (size,) = struct.unpack("<Q", fh.read(8))
    header = json.loads(fh.read(size))
    header.pop("__metadata__", None)
    return header, 8 + size


def read_box(fh, base: int, entry: dict, key: str, starts, out: torch.Tensor) -> int:
    """Read the box of file tensor `key` that starts at `starts` and has `out`'s shape into
    `out` (straight into its memory where it can take the bytes as they are); returns the bytes
    read."""
    shape, sizes = list(entry["shape"]), list(out.shape)
    if any(s + n > d for s, n, d in zip(starts, sizes, shape, strict=True)) or len(sizes) != len(
        shape
    ):
        raise RuntimeError(f"{key}: the checkpoint's shape {shape} does not hold a box {sizes}")
    if math.prod(sizes) == 0:
        return 0
    dtype = DTYPES[entry["dtype"]]
    direct = out.device.type == "cpu" and out.dtype == dtype and out.is_contiguous()
    data = read_slice(
        fh.fileno(),
        base + entry["data_offsets"][0],
        dtype,
        shape,
        list(starts),
        sizes,
        out=out.view(-1).view(torch.uint8) if direct else None,
    )
    if not direct:
        out.copy_(data.view(out.shape))
    return data.numel() * data.element_size()


def read_slice(fd: int, offset: int, dtype, shape, starts, sizes, out=None) -> torch.Tensor:
    """The block starts[d]:starts[d]+sizes[d] of a C-ordered tensor stored at `offset`, read with
    one positional read per contiguous run (a row of a column slice, or the whole block), into
    `out` (bytes of the block's size) when given."""
    item = torch.empty((), dtype=dtype).element_size()
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    whole = len(shape)  # dims from `whole` on are taken entire: they lie in one run
    while whole > 0 and starts[whole - 1] == 0 and sizes[whole - 1] == shape[whole - 1]:
        whole -= 1
    run_dim = max(whole - 1, 0)
    run = (sizes[run_dim] if shape else 1) * (strides[run_dim] if shape else 1)
    if out is None:
        out = torch.empty(math.prod(sizes) * item, dtype=torch.uint8)
    buffer = memoryview(out.numpy())
    outer = [range(starts[d], starts[d] + sizes[d]) for d in range(run_dim)]
    for i, index in enumerate(itertools.product(*outer)):
        first = sum(j * strides[d] for d, j in enumerate(index))
        first += starts[run_dim] * strides[run_dim] if shape else 0
        chunk = buffer[i * run * item : (i + 1) * run * item]
        if os.preadv(fd, [chunk], offset + first * item) != len(chunk):
            raise RuntimeError("a safetensors file ended before its header said")
    return out.view(dtype).view(sizes)
