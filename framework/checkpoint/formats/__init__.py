"""Checkpoint formats: one object per layout a strategy writes, read by one `Source` each.

A strategy plugin names the format it writes (`checkpoint_format`, recorded as "format" in each
checkpoint's meta.json); the format object says what a reader needs to know about it:

- `name`: as recorded;
- `any_world`: whether a checkpoint of it loads as written under any process count (a plain
  Lightning file) or only under the layout that wrote it (sharded formats); any other load is a
  move to another layout, which every format reads by slices anyway;
- `state`: the file or folder inside the checkpoint directory that holds the state (fixed by
  the format, never read from meta.json: what is checked is what is loaded);
- `allowed`: the classes, beyond torch's tensors and plain data, that its files may name for
  data (read by its readers through framework/checkpoint/safe.py; nothing else is unpickled);
- `movable(meta)`: why a checkpoint cannot be moved to another layout, or None;
- `open(path, trusted)`: a `Source` (framework/checkpoint/portable.py) over the state.

The built-in formats are listed in `FORMATS` ("module:attribute", imported when first asked
for); a new one is one module with one such object, added with `register`.
"""

from __future__ import annotations

import contextlib
import importlib
from pathlib import Path
from typing import Any, Protocol

from framework.checkpoint import disk
from framework.checkpoint.portable import NotPortable, Source

FORMATS = {
    "lightning": "framework.checkpoint.formats.lightning:FORMAT",
    "deepspeed": "framework.checkpoint.formats.deepspeed:FORMAT",
    "dcp": "framework.checkpoint.formats.dcp:DCP",
    "dcp_flat": "framework.checkpoint.formats.dcp:DCP_FLAT",
}
_registered: dict[str, Any] = {}


class CheckpointFormat(Protocol):
    """What a reader needs to know of one checkpoint layout (see the module docstring)."""

    name: str
    any_world: bool
    state: str
    allowed: tuple[str, ...] | set[str]

    def movable(self, meta: dict[str, Any]) -> str | None:
        """Why a checkpoint with this meta.json cannot be read into another layout (None: it
        can)."""

    def open(self, path: Path, trusted: bool = False) -> Source:
        """A Source over the state at `path` (the checkpoint directory's `state`); `trusted`:
        its pickles may name more than data."""


def register(fmt: Any) -> None:
    """Make a format known by its `name` in this process (a plugin's own layout)."""
    _registered[fmt.name] = fmt


def named(name: str) -> Any:
    """The format object of that name (NotPortable when none is known)."""
    if name in _registered:
        return _registered[name]
    if name not in FORMATS:
        raise NotPortable(f"checkpoint format '{name}' is not known (known: {', '.join(known())})")
    module, _, attr = FORMATS[name].partition(":")
    return getattr(importlib.import_module(module), attr)


def known() -> list[str]:
    return sorted({*FORMATS, *_registered})


def of(meta: dict[str, Any]) -> Any:
    """The format of a checkpoint, from its meta.json (`lightning` when it records none)."""
    return named(str(meta.get("format", "lightning")))


def open_checkpoint(ckpt: Path, trusted: bool = False) -> Source:
    """A Source over the checkpoint directory `ckpt`, in the format its meta.json records, once
    its tree holds no link nor anything but files and folders (safe.check_tree; trusted or
    not: `trusted` is about pickles). Every read of a checkpoint opens it here, so none skips
    the check (UnsafeCheckpoint)."""
    from framework.checkpoint import safe

    safe.check_tree(ckpt)
    fmt = of(disk.read_meta(ckpt))
    return fmt.open(ckpt / fmt.state, trusted)


def check_checkpoint(ckpt: Path) -> None:
    """Raise UnsafeCheckpoint unless the checkpoint directory `ckpt` reads as data: its tree
    (checked by every open), then every file its format's reader opens, opened as a load opens
    them (no tensor data read)."""
    with contextlib.closing(open_checkpoint(ckpt)) as source:
        source.model()
        source.optimizers()
        source.rest()
