"""Checkpoints are data, not code: every read of checkpoint data is type-restricted.

torch, DeepSpeed and DCP keep parts of a checkpoint as Python pickles, and unpickling runs any
callable the pickle names. Nothing here unpickles with more than an allowlist, and the readers
of every format (framework/checkpoint/formats/) go through these functions only:

- torch files (`.ckpt`, `.pt`): zip-format files only (a legacy torch file is one pickle, refused),
  read with torch's `weights_only` unpickler; a format whose files name classes of their own
  for data (DeepSpeed's ZeRO files) passes them, and they are read as inert stand-ins (DeepSpeed
  is never imported to read a checkpoint);
- plain pickles (DCP's `.metadata`): an unpickler that allows only the classes the format lists;
  DCP's byte entries: torch's `weights_only` unpickler;
- the directory itself: no link (inside it or leaving it), nothing but plain files and folders,
  checked by every open of a checkpoint (`formats.open_checkpoint`), trusted or not, so no load
  skips it: a resume, an automatic restart, an elastic generation, a SLURM requeue, the loss
  guard's rollback, an export.

`formats.check_checkpoint` runs the same readers over a checkpoint before any process starts (a resume,
an automatic restart, `fw export`), so what is checked is what is loaded, and a refusal is an
exit 2 before anything starts. `trusted` (`fw train --trust`, which sets
`run.trust_checkpoint=true`, and `fw export --trust`) lifts the restriction for a checkpoint of
your own that carries classes of yours: its pickles are then unpickled as they are.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import zipfile
from pathlib import Path
from typing import Any


class UnsafeCheckpoint(Exception):
    """A checkpoint file names something that loading it would run, or its directory holds
    what a checkpoint never does (a link, a device); the message says what."""


class StandIn:
    """Takes the place of a class a checkpoint names for data only (DeepSpeed's loss scaler,
    stage enum, fragment address): it keeps its arguments and state, runs nothing."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, dict):
            self.__dict__.update(state)

    @property
    def value(self) -> Any:
        """The enum value a stand-in for an Enum was built with (`ZeroStageEnum(3)` -> 3)."""
        return self.args[0] if self.args else None


def load_torch(
    path: Path,
    where: str | Path | None = None,
    *,
    meta: bool = False,
    mmap: bool = False,
    trusted: bool = False,
    stand_ins: tuple[str, ...] = (),
) -> Any:
    """A zip-format torch file read with torch's `weights_only` unpickler (`trusted`: without
    it): `meta` builds every tensor on the meta device (no data read; each storage's place in
    the file is its `_checkpoint_offset`), `mmap` maps the file (a tensor's data is read when
    touched); the classes named in `stand_ins` (a format's own data classes) are read as
    StandIns."""
    import torch

    where = where if where is not None else path.name
    if not zipfile.is_zipfile(path):
        raise UnsafeCheckpoint(
            f"{where} is not a zip-format torch file (a legacy torch file is one pickle, which "
            "is never read)"
        )
    allowed = [(StandIn, name) for name in stand_ins]
    with refusals(where), torch.serialization.safe_globals(allowed):
        return torch.load(
            path,
            map_location="meta" if meta else "cpu",
            weights_only=not trusted,
            mmap=mmap and not meta,
        )


@contextlib.contextmanager
def refusals(where: Any, unreadable: bool = True):
    """torch's refusals as UnsafeCheckpoint naming `where`: a global its weights_only unpickler
    refused (torch names it), and (`unreadable`) a file it cannot read at all."""
    caught = (RuntimeError, OSError, EOFError, ValueError) if unreadable else ()
    try:
        yield
    except pickle.UnpicklingError as err:
        named = re.search(r"GLOBAL ([\w.]+)", str(err))  # torch names the global it refused
        what = f"names {named.group(1)}" if named else _unpickler_line(str(err))
        raise UnsafeCheckpoint(f"{where} {what}, which a checkpoint never needs") from None
    except caught as err:
        raise UnsafeCheckpoint(f"{where} is not a readable torch file ({err})") from None


def load_stream(stream: Any, where: str, trusted: bool = False) -> Any:
    """A torch file inside a larger file (a DCP chunk: `stream` a view of its bytes), read with
    its tensors on the meta device and torch's `weights_only` unpickler (`trusted`: without it)."""
    import torch

    with refusals(where):
        return torch.load(stream, map_location="meta", weights_only=not trusted)


def load_bytes(data: Any, where: str, trusted: bool = False) -> Any:
    """An object torch.save wrote into a buffer (DCP's byte entries), with `weights_only`
    (`trusted`: without it)."""
    import torch

    with refusals(where, unreadable=False):
        return torch.load(data, map_location="cpu", weights_only=not trusted)


def load_pickle(path: Path, allowed: set[str], where: str | Path, trusted: bool = False) -> Any:
    """A plain pickle (DCP's `.metadata`) read with only the `allowed` globals (`trusted`: as
    it is)."""
    with path.open("rb") as fh:
        if trusted:
            return pickle.load(fh)  # noqa: S301 - the user vouched for this checkpoint
        try:
            return _Restricted(fh, allowed).load()
        except UnsafeCheckpoint as err:
            raise UnsafeCheckpoint(f"{where} {err}") from None
        except Exception as err:  # a damaged pickle is refused as well
            raise UnsafeCheckpoint(f"{where} is not a readable pickle ({err})") from None


def check_tree(root: Path) -> None:
    """Nothing in the checkpoint directory `root` is a link or anything but a plain file or a
    folder (a link could point a reader anywhere on the machine). Runs on every open of a
    checkpoint, on every rank: one directory listing per folder, the entries' types as the
    listing gives them (no stat of each file on file systems that report types)."""
    if root.is_symlink():
        raise UnsafeCheckpoint(f"{root.name} is a link; a checkpoint is a plain directory")
    folders = [root]
    while folders:
        with os.scandir(folders.pop()) as entries:
            for entry in entries:
                if entry.is_symlink():
                    where = Path(entry.path).relative_to(root.parent)
                    raise UnsafeCheckpoint(f"{where} is a link, which a checkpoint never holds")
                if entry.is_dir(follow_symlinks=False):
                    folders.append(Path(entry.path))
                elif not entry.is_file(follow_symlinks=False):
                    where = Path(entry.path).relative_to(root.parent)
                    raise UnsafeCheckpoint(f"{where} is not a plain file or folder")


def inside(root: Path, relative: str, what: str) -> Path:
    """`root / relative` when that names a file directly under `root` by a plain name (no
    folder part, no absolute path, no `..`), else UnsafeCheckpoint naming `what`."""
    if not relative or os.sep in relative or relative.startswith(".") or "/" in relative:
        raise UnsafeCheckpoint(f"{what} names {relative!r}, which is not a file of the checkpoint")
    return root / relative


def _unpickler_line(message: str) -> str:
    lines = [line.strip() for line in message.splitlines() if "Unpickler error" in line]
    return lines[0] if lines else "holds something torch's weights_only loading refuses"


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
