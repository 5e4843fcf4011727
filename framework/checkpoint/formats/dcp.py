"""`dcp` and `dcp_flat`: torch.distributed.checkpoint directories (the parallel strategy).

A DCP directory holds `.metadata` (a pickle: every saved tensor's whole size and the chunks it
was saved in, each chunk's file, offset and length), one `.distcp` file per saving rank, and the
rest of Lightning's checkpoint as `meta.pt`. Tensors are keyed `state_dict.<name>` (the model)
and `optimizer_<i>.state.<name>.<entry>`; the param groups are byte entries,
`optimizer_<i>.param_groups.<group>.<setting>` (`dcp`, with each group's `params` a list of
names) or `optimizer_<i>.param_groups.<name>.<setting>` (`dcp_flat`, written per parameter by
pipeline stages; parameters with the same settings make one group).

Read here without torch's load planner: the metadata with an unpickler that knows only DCP's
metadata classes (every file it names must be a plain file of the directory), byte entries with
torch's `weights_only` loader. Each saved chunk is a small torch file inside its `.distcp` file:
its pickle is read with tensors on the meta device (`weights_only`), and the part of its data
that overlaps a requested box is read by position (torchfile.py), so a rank reads the bytes of
its own boxes and holds one piece of one tensor at a time beyond them.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import torch

from framework.checkpoint import safe
from framework.checkpoint.formats.torchfile import TorchFile
from framework.checkpoint.portable import (
    MODEL,
    NotPortable,
    OptimizerSpec,
    Read,
    TensorSpec,
)

MODEL_PREFIX = "state_dict."
# The classes DCP's `.metadata` is made of (torch 2.13): all its unpickler allows.
ALLOWED = {
    *(
        f"torch.distributed.checkpoint.metadata.{name}"
        for name in (
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorProperties",
            "TensorStorageMetadata",
            "ChunkStorageMetadata",
            "BytesStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        )
    ),
    "torch.distributed.checkpoint.filesystem._StorageInfo",
    "torch.Size",
    "torch.serialization._get_layout",
    "pathlib.PosixPath",
    "pathlib.PurePosixPath",
    "pathlib._local.PosixPath",
    "pathlib._local.PurePosixPath",
    "collections.OrderedDict",
}


class DCPSource:
    """A Source (framework/checkpoint/portable.py) over one DCP directory."""

    def __init__(self, path: Path, flat: bool, trusted: bool = False) -> None:
        self.path, self.flat, self.trusted = path, flat, trusted
        self.where = f"{path.parent.name}/{path.name}"
        self.metadata = safe.load_pickle(
            path / ".metadata", ALLOWED, f"{self.where}/.metadata", trusted
        )
        if type(self.metadata).__name__ != "Metadata":
            raise safe.UnsafeCheckpoint(f"{self.where}/.metadata is not DCP metadata")
        for info in self.metadata.storage_data.values():
            safe.inside(path, str(info.relative_path), f"{self.where}/.metadata")
        self.entries = self.metadata.state_dict_metadata
        self._optimizers: list[OptimizerSpec] | None = None
        self.files: dict[Path, TorchFile] = {}  # the .distcp files opened, by path

    # ---- what it holds
    def model(self) -> dict[str, TensorSpec]:
        return {
            key.removeprefix(MODEL_PREFIX): _spec(md)
            for key, md in self.entries.items()
            if key.startswith(MODEL_PREFIX) and hasattr(md, "chunks")
        }

    def optimizers(self) -> list[OptimizerSpec]:
        if self._optimizers is None:
            count = len({k.split(".", 1)[0] for k in self.entries if k.startswith("optimizer_")})
            self._optimizers = [self._optimizer(i) for i in range(count)]
        return self._optimizers

    def _optimizer(self, index: int) -> OptimizerSpec:
        prefix = f"optimizer_{index}."
        state: dict[str, dict[str, Any]] = {}
        settings: dict[str, dict[str, Any]] = {}
        for key, md in self.entries.items():
            if not key.startswith(prefix):
                continue
            section, _, rest = key[len(prefix) :].partition(".")
            owner, _, entry = rest.rpartition(".")
            value = _spec(md) if hasattr(md, "chunks") else self.load_bytes(key)
            if section == "state":
                state.setdefault(owner, {})[entry] = value
            elif section == "param_groups":
                settings.setdefault(owner, {})[entry] = value
        groups = (
            _flat_groups(settings)
            if self.flat
            else [settings[g] for g in sorted(settings, key=int)]
        )
        return OptimizerSpec([dict(g) for g in groups], state)

    def rest(self) -> dict[str, Any]:
        return safe.load_torch(self.path / "meta.pt", f"{self.where}/meta.pt", trusted=self.trusted)

    # ---- reading
    def key_of(self, key: tuple) -> str:
        if key[0] == MODEL:
            return MODEL_PREFIX + key[1]
        _, index, name, entry = key
        return f"optimizer_{index}.state.{name}.{entry}"

    def read(self, requests: list[Read]) -> None:
        for request in requests:
            fqn = self.key_of(request.key)
            md = self.entries.get(fqn)
            if md is None or not hasattr(md, "chunks"):
                raise NotPortable(f"{self.where} holds no tensor {fqn}")
            self._read_box(fqn, md, tuple(request.offset), request.out)

    def _read_box(self, fqn: str, md: Any, offset: tuple, out: torch.Tensor) -> None:
        """The box's overlap with every saved chunk, read from that chunk by position."""
        size = tuple(out.shape)
        for index, chunk in enumerate(md.chunks):
            low = [max(o, c) for o, c in zip(offset, chunk.offsets, strict=True)]
            high = [
                min(o + s, c + n)
                for o, s, c, n in zip(offset, size, chunk.offsets, chunk.sizes, strict=True)
            ]
            if any(lo >= hi for lo, hi in zip(low, high, strict=True)):
                continue
            saved, file, start = self._saved_chunk(fqn, chunk, index)
            target = out
            for d, (lo, hi) in enumerate(zip(low, high, strict=True)):
                target = target.narrow(d, lo - offset[d], hi - lo)
            within = tuple(lo - c for lo, c in zip(low, chunk.offsets, strict=True))
            file.read_box(saved, within, target, base=start)

    def _saved_chunk(self, fqn: str, chunk: Any, index: int) -> tuple[torch.Tensor, Any, int]:
        """(the saved chunk as a meta tensor, its open file, where its torch file starts): only
        the chunk's own small pickle is read (type-restricted), never its data."""
        from torch.distributed.checkpoint.metadata import MetadataIndex
        from torch.distributed.checkpoint.utils import _create_file_view

        info = self.metadata.storage_data[MetadataIndex(fqn, chunk.offsets, index)]
        path = safe.inside(self.path, str(info.relative_path), f"{self.where}/.metadata")
        file = self.files.get(path)
        if file is None:
            file = self.files[path] = TorchFile(path)
        with open(path, "rb") as fh:
            view = _create_file_view(fh, info.offset, info.length)
            saved = safe.load_stream(view, f"{self.where} {fqn}", self.trusted)
        if not isinstance(saved, torch.Tensor) or tuple(saved.shape) != tuple(chunk.sizes):
            raise NotPortable(f"{self.where}: the saved chunk of {fqn} is not its recorded shape")
        return saved, file, info.offset

    def _file_bytes(self, info: Any) -> bytes:
        path = safe.inside(self.path, str(info.relative_path), f"{self.where}/.metadata")
        with open(path, "rb") as fh:
            data = os.pread(fh.fileno(), info.length, info.offset)
        if len(data) != info.length:
            raise NotPortable(f"{path} is shorter than its metadata says (truncated?)")
        return data

    def load_bytes(self, fqn: str) -> Any:
        """A byte entry (a param group setting, a non-tensor state)."""
        from torch.distributed.checkpoint.metadata import MetadataIndex

        info = self.metadata.storage_data[MetadataIndex(fqn)]
        return safe.load_bytes(
            io.BytesIO(self._file_bytes(info)), f"{self.where} {fqn}", self.trusted
        )

    def largest_read(self) -> int:
        """One piece of the largest saved chunk (read by position, like a torch file)."""
        from framework.checkpoint.formats.torchfile import largest_piece

        chunks = {
            f"{key}/{i}": TensorSpec(tuple(c.sizes), md.properties.dtype)
            for key, md in self.entries.items()
            if hasattr(md, "chunks")
            for i, c in enumerate(md.chunks)
        }
        return largest_piece(chunks, [])

    @property
    def bytes_read(self) -> int:
        return sum(f.bytes_read for f in self.files.values())

    def close(self) -> None:
        for file in self.files.values():
            file.close()
        self.files.clear()


def _spec(md: Any) -> TensorSpec:
    return TensorSpec(tuple(md.size), md.properties.dtype)


def _flat_groups(settings: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Param groups from settings saved per parameter name: parameters with the same settings
    make one group, in the order they first appear."""
    groups: list[dict[str, Any]] = []
    for name, values in settings.items():
        group = next((g for g in groups if _same(g, values)), None)
        if group is None:
            group = {**values, "params": []}
            groups.append(group)
        group["params"].append(name)
    return groups


def _same(group: dict[str, Any], values: dict[str, Any]) -> bool:
    keys = set(group) - {"params"}
    return keys == set(values) and all(str(group[k]) == str(values[k]) for k in keys)


class DCPFormat:
    """A DCP directory: loads as written only under the layout that wrote it."""

    any_world = False
    state = "state.ckpt"
    allowed = ALLOWED

    def __init__(self, name: str, flat: bool) -> None:
        self.name, self.flat = name, flat

    def movable(self, meta: dict[str, Any]) -> str | None:
        return None

    def open(self, path: Path, trusted: bool = False) -> DCPSource:
        return DCPSource(path, self.flat, trusted)


DCP = DCPFormat("dcp", flat=False)
DCP_FLAT = DCPFormat("dcp_flat", flat=True)
