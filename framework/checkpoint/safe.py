"""Checkpoints are data, not code: what a checkpoint's pickles may name, checked before loading.

torch, DeepSpeed and DCP keep parts of a checkpoint as Python pickles, and unpickling runs any
callable the pickle names. Before `fw train` resumes from (or moves) a checkpoint, and before
`fw export` reads one, every pickle in it is read without building anything it names:

- torch files (`.ckpt`, `.pt`, the zip format): torch's own `weights_only` unpickler, with the
  three DeepSpeed classes its ZeRO files name declared as stand-ins (DeepSpeed is not imported);
  storages are memory-mapped, so no tensor data is read;
- DCP's `.metadata` (a plain pickle): an unpickler that allows only the classes DCP's metadata is
  made of;
- any other pickle is refused; raw tensor data (`.distcp`), JSON and text are not pickles.

A checkpoint that names anything else is refused before any process starts, naming the file and
what it names; `--trust` loads it anyway (for checkpoints of your own that carry classes of
yours). The checkpoints this framework writes pass, so resuming a run of your own needs nothing.
"""

from __future__ import annotations

import pickle
import re
import zipfile
from pathlib import Path

from framework.checkpoint import disk

# What a DeepSpeed ZeRO optimizer file names besides torch's tensors (DeepSpeed 0.19).
DEEPSPEED_GLOBALS = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)
# What DCP's `.metadata` is made of (torch 2.13).
DCP_GLOBALS = {
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
    "collections.OrderedDict",
}
NOT_PICKLES = {".json", ".distcp", ".py", ".txt", ".yaml", ".md"}


class UnsafeCheckpoint(Exception):
    """A checkpoint file names something that loading it would run; the message says what."""


def check_checkpoint(ckpt: Path) -> None:
    """Raise UnsafeCheckpoint when a pickle in the checkpoint directory names more than data."""
    meta = disk.read_meta(ckpt)
    state = ckpt / meta.get("state", "state.ckpt")
    found = [state] if state.is_file() else sorted(p for p in state.rglob("*") if p.is_file())
    for path in found:
        if path.suffix in NOT_PICKLES or path.name == "latest":
            continue  # DeepSpeed's copies of its own scripts are never run by the framework
        where = path.relative_to(ckpt.parent)
        if zipfile.is_zipfile(path):
            check_torch_file(path, where)
        elif path.name == ".metadata":
            check_pickle(path, DCP_GLOBALS, where)
        elif path.read_bytes()[:1] == b"\x80":  # a pickle's protocol opcode
            raise UnsafeCheckpoint(f"{where} is a pickle of a kind this framework does not write")


def check_torch_file(path: Path, where: Path | str) -> None:
    import torch

    stand_ins = [(_StandIn, name) for name in DEEPSPEED_GLOBALS]
    try:
        with torch.serialization.safe_globals(stand_ins):
            torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as err:
        named = re.search(r"GLOBAL ([\w.]+)", str(err))  # torch names the global it refused
        what = f"names {named.group(1)}" if named else _unpickler_line(str(err))
        raise UnsafeCheckpoint(f"{where} {what}, which a checkpoint never needs") from None
    except (RuntimeError, OSError, EOFError) as err:
        raise UnsafeCheckpoint(f"{where} is not a readable torch file ({err})") from None


def check_pickle(path: Path, allowed: set[str], where: Path | str) -> None:
    with path.open("rb") as fh:
        try:
            _Restricted(fh, allowed).load()
        except UnsafeCheckpoint as err:
            raise UnsafeCheckpoint(f"{where} {err}") from None
        except Exception as err:  # a damaged pickle is refused as well
            raise UnsafeCheckpoint(f"{where} is not a readable pickle ({err})") from None


def _unpickler_line(message: str) -> str:
    lines = [line.strip() for line in message.splitlines() if "Unpickler error" in line]
    return lines[0] if lines else "holds something torch's weights_only loading refuses"


def deepspeed_globals() -> list:
    """The real DeepSpeed classes its ZeRO files name, for loading them with weights_only."""
    import importlib

    found = []
    for name in DEEPSPEED_GLOBALS:
        module, _, attr = name.rpartition(".")
        found.append(getattr(importlib.import_module(module), attr))
    return found


class _StandIn:
    """Takes the place of a DeepSpeed class while a file is only checked."""

    def __init__(self, *args, **kwargs) -> None:
        pass


class _Restricted(pickle.Unpickler):
    def __init__(self, fh, allowed: set[str]) -> None:
        super().__init__(fh)
        self.allowed = allowed

    def find_class(self, module: str, name: str):
        import torch

        qualified = f"{module}.{name}"
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if qualified not in self.allowed and not dtype:
            raise UnsafeCheckpoint(f"names {qualified}, which a checkpoint never needs")
        return super().find_class(module, name)

    def persistent_load(self, pid):
        raise UnsafeCheckpoint("holds a persistent reference, which DCP metadata never has")
