"""`fw export RUN_DIR_OR_CHECKPOINT OUT [--format pt|hf]`: the trained model, loadable without
this framework, written in bounded memory.

`pt` (the default): a `dict[str, torch.Tensor]` in torch's zip format, so
`torch.load(path, weights_only=True)` reads it anywhere torch is installed. Keys are those of the
task module's `state_dict()` (e.g. `model.blocks.0.attn.qkv.weight`). `hf`: the task's
transformers model as a directory `from_pretrained` loads (a model family's export format,
framework/integrations/hf/export.py).

The checkpoint, of any layout, is read one tensor at a time by its format's type-restricted
reader (framework/checkpoint/formats): the file's layout is written first with every tensor's
place reserved (torch's `skip_data`), then each tensor is read and written into its place and
let go. The exporting process holds about one tensor at a time, never the model.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import secrets
from pathlib import Path

from framework.checkpoint import disk, formats, resume
from framework.checkpoint.portable import NotPortable, Source, full_state, model_key, whole
from framework.errors import ConfigError

log = logging.getLogger("framework.checkpoint.export")

# --format: the plain state dict written here, or a model family's own layout, its module
# imported only when chosen ("module", with check_options(max_shard_size) and
# write(ckpt, out, source, max_shard_size, force, trust))
FORMATS = {"pt": None, "hf": "framework.integrations.hf.export"}
FILE_MODE = 0o640


def consolidated_state(ckpt: Path) -> dict:
    """Every model tensor of a checkpoint in memory at once, as CPU tensors: for inspecting
    small checkpoints (tests, debugging); `fw export` streams instead."""
    with contextlib.closing(formats.open_checkpoint(ckpt)) as source:
        return full_state(source)


def export(
    source: Path,
    out: Path,
    force: bool = False,
    trust: bool = False,
    fmt: str = "pt",
    max_shard_size: str | None = None,
) -> Path:
    """`trust`: read a checkpoint whose pickles name more than data (framework.checkpoint.safe);
    `max_shard_size`: the largest safetensors file of `fmt="hf"`."""
    if fmt not in FORMATS:
        raise ConfigError("--format", fmt, "unknown export format", list(FORMATS))
    if max_shard_size is not None and FORMATS[fmt] is None:
        sharded = [name for name, module in FORMATS.items() if module]
        raise ConfigError(
            "--max-shard-size", max_shard_size, f"does not apply to --format {fmt}", sharded
        )
    if out.exists() and not force:
        raise ConfigError(
            "out", str(out), "already exists", hint="Choose another path or add --force."
        )
    if not out.parent.is_dir():
        raise ConfigError("out", str(out), f"directory {out.parent} does not exist")
    writer = importlib.import_module(FORMATS[fmt]) if FORMATS[fmt] else None
    if writer is not None:
        writer.check_options(max_shard_size)  # refused before any reading
    ckpt = disk.resolve(source, "source")
    resume.check_safe(ckpt, "source", trust)
    try:
        reader = formats.open_checkpoint(ckpt, trusted=trust)
    except NotPortable as err:
        raise ConfigError("source", str(ckpt), f"is not a readable checkpoint: {err}") from None
    with contextlib.closing(reader):
        if writer is not None:
            return writer.write(ckpt, out, reader, max_shard_size, force, trust)
        count = write_state_file(reader, out)
    log.info("Exported %d tensors from %s to %s", count, ckpt, out)
    return out


def write_state_file(source: Source, out: Path) -> int:
    """The model's tensors as one torch file at `out`, whole or not at all (written under a
    fresh hidden name, then renamed; a planted symlink is not followed): the layout first, each
    tensor's bytes reserved, then one tensor at a time into its place."""
    import torch

    specs = source.model()
    tmp = out.with_name(f".{out.name}.{secrets.token_hex(6)}.tmp")
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(tmp, flags, FILE_MODE)
    try:
        with os.fdopen(fd, "w+b") as fh:
            # virtual memory only: torch.empty does not touch the pages skip_data leaves unwritten
            placeholders = {n: torch.empty(s.shape, dtype=s.dtype) for n, s in specs.items()}
            with torch.serialization.skip_data():
                torch.save(placeholders, fh)
            del placeholders
            fh.flush()
            fh.seek(0)
            layout = torch.load(fh, map_location="meta", weights_only=True)
            for name, spec in specs.items():
                tensor = whole(source, model_key(name), spec).contiguous()
                place = layout[name].untyped_storage()._checkpoint_offset
                data = tensor.view(-1).view(torch.uint8).numpy() if tensor.numel() else b""
                os.pwrite(fh.fileno(), memoryview(data), place)
                del tensor, data
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    disk.fsync_dir(out.parent)
    return len(specs)
