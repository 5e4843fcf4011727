"""`fw export RUN_DIR_OR_CHECKPOINT OUT [--format pt|hf]`: the trained model, loadable without
this framework.

`pt` (the default): a `dict[str, torch.Tensor]` saved with `torch.save`, so
`torch.load(path, weights_only=True)` reads it anywhere torch is installed. Keys are those of the
task module's `state_dict()` (e.g. `model.blocks.0.attn.qkv.weight`). `hf`: the task's
transformers model as a directory `from_pretrained` loads (framework.integrations.hf.export).
"""

from __future__ import annotations

import importlib
import logging
import os
from pathlib import Path

from framework import files
from framework.checkpoint import disk, portable, resume
from framework.errors import ConfigError

log = logging.getLogger("framework.checkpoint.export")


def consolidated_state(ckpt: Path) -> dict:
    """The full, unsharded model state of a checkpoint, as CPU tensors."""
    import torch

    meta = disk.read_meta(ckpt)
    fmt = meta.get("format", "lightning")
    path = ckpt / meta.get("state", "state.ckpt")
    if fmt == "lightning":
        tensors = torch.load(path, map_location="cpu", weights_only=True)["state_dict"]
    elif fmt == "deepspeed":
        tensors = deepspeed_state(path)
    elif fmt in ("dcp", "dcp_flat"):
        tensors = portable.read_dcp(path).model
    else:
        raise ConfigError(
            "source",
            str(ckpt),
            f"checkpoint format '{fmt}' cannot be exported",
            ["lightning", "deepspeed", "dcp", "dcp_flat"],
        )
    return {
        k: v.detach().cpu().contiguous().clone()
        for k, v in tensors.items()
        if isinstance(v, torch.Tensor)
    }


def deepspeed_state(path: Path) -> dict:
    """Gather the fp32 weights of a DeepSpeed checkpoint (any stage, any process count)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    state = get_fp32_state_dict_from_zero_checkpoint(str(path), tag="checkpoint")
    prefix = "_forward_module."  # Lightning's wrapper around the task module
    return {k.removeprefix(prefix): v for k, v in state.items()}


# --format: the plain state dict written here, or a model family's own layout, its module
# imported only when chosen ("module", with check_options(max_shard_size) and
# write(ckpt, out, read_state, max_shard_size, force))
FORMATS = {"pt": None, "hf": "framework.integrations.hf.export"}


def export(
    source: Path,
    out: Path,
    force: bool = False,
    trust: bool = False,
    fmt: str = "pt",
    max_shard_size: str | None = None,
) -> Path:
    """`trust`: read a checkpoint whose pickles name more than data (see framework.checkpoint.safe);
    `max_shard_size`: the largest safetensors file of `fmt="hf"`."""
    import torch

    if fmt not in FORMATS:
        raise ConfigError("--format", fmt, "unknown export format", list(FORMATS))
    if max_shard_size is not None and fmt != "hf":
        raise ConfigError("--max-shard-size", max_shard_size, "applies to --format hf only")
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
    if not trust:
        resume.check_safe(ckpt, "source")
    if writer is not None:
        return writer.write(ckpt, out, consolidated_state, max_shard_size, force)
    state = consolidated_state(ckpt)
    # whole or not at all, under a fresh temporary name (a planted symlink is not followed)
    files.write_atomic_with(out, lambda fh: torch.save(state, fh))
    log.info("Exported %d tensors from %s to %s", len(state), ckpt, out)
    return out
