"""A checkpoint (any format, framework/checkpoint/formats/) read into a model and its optimizers,
whatever layout they have now: each rank reads only the boxes of each saved tensor it holds.

The targets are the tensors the rank keeps: a parameter or buffer whole (ddp, diloco, hogwild:
every rank keeps the whole model), a DTensor's local part (fsdp, tensor, pipeline, expert and
context parallel: the box of the whole tensor that torch says this rank holds), and for the
optimizer the same shapes as its parameters, made here and handed to `load_state_dict`. ZeRO
partitions are filled by the DeepSpeed strategy itself (framework/strategies/deepspeed), with the
same reads. Names are the task's (`state_dict()` names); a tied weight is found under whichever of
its names the checkpoint holds (`aliases`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from framework.checkpoint import formats
from framework.checkpoint.portable import (
    NotPortable,
    Read,
    Source,
    TensorSpec,
    full_state,
    group_of,
    model_key,
    state_key,
    whole,
)

Aliases = Callable[[str], Iterable[str]]


def same(name: str) -> list[str]:
    return [name]


@contextlib.contextmanager
def measured(source: Source, run_dir: Any, rank: int, phase: str) -> Any:
    """Record what one phase of reading a checkpoint cost this rank, appended to
    run_dir/resume/rank<R>.json: the bytes it filled and kept (`held`, set by the caller on the
    yielded dict), the bytes its reader read and the kernel counted (`read`, `io_read`), and its
    resident high-water mark's rise above where the phase started (`peak_rise`): beyond `held`,
    what the reading itself cost."""
    import json
    from pathlib import Path

    from framework import files
    from framework.memory import bytes_read, peak_rss, reset_peak_rss

    figures: dict[str, Any] = {"phase": phase, "held": 0}
    start, io0, read0 = reset_peak_rss(), bytes_read(), getattr(source, "bytes_read", 0)
    yield figures
    figures["peak_rise"] = max(0, peak_rss() - start)
    figures["io_read"] = bytes_read() - io0
    figures["read"] = getattr(source, "bytes_read", 0) - read0
    if run_dir is None:
        return
    path = Path(run_dir) / "resume" / f"rank{rank}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    earlier = json.loads(path.read_text()) if path.exists() else []
    files.write_atomic(path, json.dumps([*earlier, figures], indent=1))


def filled(reads: list[Read]) -> int:
    """Bytes the reads fill (what the rank keeps of the checkpoint)."""
    return sum(r.out.numel() * r.out.element_size() for r in reads)


def box_of(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """(the part of `tensor` this rank holds, its offset in the whole tensor): a DTensor's local
    tensor and the offset torch computes for its placements, a plain tensor whole."""
    if hasattr(tensor, "device_mesh"):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        local = tensor._local_tensor
        _, offset = compute_local_shape_and_global_offset(
            tensor.shape, tensor.device_mesh, tensor.placements
        )
        return local, tuple(offset)
    return tensor, (0,) * tensor.dim()


def reads_into(tensor: torch.Tensor, key: tuple) -> list[Read]:
    """The read that fills this rank's part of `tensor` from the saved tensor `key`."""
    local, offset = box_of(tensor)
    if local.numel() == 0 and local.dim() > 0:
        return []
    return [Read(key, local.data if isinstance(local, torch.nn.Parameter) else local, offset)]


def saved_name(name: str, saved: dict[str, Any], aliases: Aliases) -> str | None:
    """The name under which the checkpoint holds `name` (itself, or a tied alias)."""
    return next((n for n in (name, *aliases(name)) if n in saved), None)


@torch.no_grad()
def load_model(model: torch.nn.Module, source: Source, aliases: Aliases = same) -> int:
    """Every parameter and persistent buffer of `model` (its part on this rank) from `source`;
    NotPortable names one the checkpoint lacks or holds in another shape. Returns the bytes
    read into it."""
    saved = source.model()
    reads: list[Read] = []
    for name, tensor in model.state_dict(keep_vars=True).items():
        if not isinstance(tensor, torch.Tensor):
            continue
        found = saved_name(name, saved, aliases)
        if found is None:
            raise NotPortable(f"the checkpoint holds no {name}")
        if tuple(tensor.shape) != saved[found].shape:
            raise NotPortable(
                f"{name} is {tuple(tensor.shape)} here and {saved[found].shape} in the checkpoint"
            )
        reads += reads_into(tensor, model_key(found))
    source.read(reads)
    return filled(reads)


@torch.no_grad()
def load_optimizers(
    optimizers: list[torch.optim.Optimizer],
    source: Source,
    names: dict[int, str],
    aliases: Aliases = same,
) -> int:
    """Each optimizer's state and hyperparameters from `source`, matched by parameter name
    (`names`: id(parameter) -> its name in the task); the state tensors are made in the shape
    and placement of their parameters, this rank's part read into them. Returns the bytes
    read."""
    saved = source.optimizers()
    if len(saved) != len(optimizers):
        raise NotPortable(
            f"the checkpoint holds {len(saved)} optimizer(s), the task configures {len(optimizers)}"
        )
    total = 0
    for index, (optimizer, spec) in enumerate(zip(optimizers, saved, strict=True)):
        state: dict[int, dict[str, Any]] = {}
        groups: list[dict[str, Any]] = []
        reads: list[Read] = []
        position = 0
        for group in optimizer.param_groups:
            params = list(group["params"])
            found = [saved_name(names[id(p)], spec.state, aliases) or names[id(p)] for p in params]
            settings = group_of(spec.groups, found) if params else _settings(group)
            ids = list(range(position, position + len(params)))
            groups.append({**settings, "params": ids})
            for i, param, name in zip(ids, params, found, strict=True):
                if name in spec.state:
                    state[i], more = _entries(param, index, name, spec.state[name])
                    reads += more
            position += len(params)
        source.read(reads)
        total += filled(reads)
        optimizer.load_state_dict({"state": state, "param_groups": groups})
    return total


def _entries(param, index: int, name: str, saved: dict[str, Any]) -> tuple[dict, list[Read]]:
    """A parameter's optimizer state made empty in its shapes, and the reads that fill it."""
    entries, reads = {}, []
    for entry, value in saved.items():
        if not isinstance(value, TensorSpec):
            entries[entry] = value
            continue
        if value.shape == tuple(param.shape) and value.shape:
            tensor = torch.empty_like(param, dtype=value.dtype)  # its placements too
        else:
            tensor = torch.empty(value.shape, dtype=value.dtype)  # a scalar (Adam's step)
        entries[entry] = tensor
        reads += reads_into(tensor, state_key(index, name, entry))
    return entries, reads


def _settings(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


@dataclass
class Whole:
    """Everything a checkpoint holds, read whole (`read_whole`)."""

    model: dict[str, Any]
    optimizers: list[dict[str, Any]]  # {"state": {name: {entry: value}}, "groups": [...]}
    rest: dict[str, Any]


def read_whole(ckpt: Any) -> Whole:
    """Everything the checkpoint directory `ckpt` holds, in memory at once and keyed by name:
    for inspecting small checkpoints (tests, debugging), never on a path that runs at the sizes
    users train."""
    with contextlib.closing(formats.open_checkpoint(ckpt)) as source:
        optimizers = []
        for index, spec in enumerate(source.optimizers()):
            state = {
                name: {
                    entry: whole(source, state_key(index, name, entry), value)
                    if isinstance(value, TensorSpec)
                    else value
                    for entry, value in entries.items()
                }
                for name, entries in spec.state.items()
            }
            optimizers.append({"state": state, "groups": spec.groups})
        return Whole(full_state(source), optimizers, source.rest())
