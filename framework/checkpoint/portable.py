"""A checkpoint in a form that any strategy and process count can load (cross-layout resume).

Each strategy writes its own layout: one Lightning file (ddp), per-rank ZeRO partitions
(DeepSpeed), or torch.distributed.checkpoint shards (fsdp). `read` turns any of them into the
same full, unsharded state keyed by parameter name, with the partition padding removed:

- `model`: the task's `state_dict()` (parameters and buffers), full tensors;
- `optimizers`: per optimizer, `state` (parameter name -> {"exp_avg": full tensor, "step": ...})
  and `groups` (the hyperparameters of each param group and the names of its parameters);
- `rest`: everything else in the Lightning checkpoint (loops, callbacks, LR schedulers, epoch).

The strategy resuming the run loads that into its own sharding (its `load_portable`, reached
through `framework.strategy_base.StrategyBase`).
Every process reads the whole checkpoint once, in CPU memory.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from framework.checkpoint import disk
from framework.checkpoint.safe import deepspeed_globals

WRAPPER_PREFIX = "_forward_module."  # Lightning's wrapper around the task module under DeepSpeed
# What a DeepSpeed checkpoint holds besides the Lightning client state.
DEEPSPEED_KEYS = {
    "module",
    "buffer_names",
    "optimizer",
    "param_shapes",
    "frozen_param_shapes",
    "shared_params",
    "frozen_param_fragments",
    "lr_scheduler",
    "data_sampler",
    "random_ltd",
    "sparse_tensor_module_names",
    "skipped_steps",
    "global_steps",
    "global_samples",
    "dp_world_size",
    "mp_world_size",
    "checkpoint_parallel_dimensions",
    "ds_config",
    "ds_version",
}
NAMES_KEY = "parameter_names"  # written into Lightning-format checkpoints by the checkpointer


class NotPortable(Exception):
    """This checkpoint cannot be moved to another layout (the message says why)."""


@dataclass
class Portable:
    model: dict[str, Any]
    optimizers: list[dict[str, Any]]
    rest: dict[str, Any] = field(default_factory=dict)


def read(ckpt: Path) -> Portable:
    """The full state of a checkpoint directory written by any strategy."""
    meta = disk.read_meta(ckpt)
    fmt = meta.get("format", "lightning")
    path = ckpt / meta.get("state", "state.ckpt")
    readers = {
        "lightning": read_lightning,
        "deepspeed": read_deepspeed,
        "dcp": read_dcp,
        "dcp_flat": read_dcp,
    }
    if fmt not in readers:
        raise NotPortable(f"checkpoint format '{fmt}' is not known")
    return readers[fmt](path)


def read_lightning(path: Path) -> Portable:
    import torch

    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    names = ckpt.pop(NAMES_KEY, None)
    states = ckpt.pop("optimizer_states", [])
    model = ckpt.pop("state_dict")
    if names is None and states:
        raise NotPortable(
            "it was written before checkpoints recorded their parameter names, so its "
            "optimizer state cannot be matched to the parameters of another layout"
        )
    optimizers = []
    for state, group_names in zip(states, names or [], strict=True):
        by_index: dict[int, str] = {}
        groups = []
        for group, gnames in zip(state["param_groups"], group_names, strict=True):
            by_index.update(zip(group["params"], gnames, strict=True))
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": gnames})
        per_param = {by_index[i]: s for i, s in state["state"].items()}
        optimizers.append({"state": per_param, "groups": groups})
    return Portable(model=model, optimizers=optimizers, rest=ckpt)


def read_dcp(path: Path) -> Portable:
    import tempfile

    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        whole = Path(tmp) / "whole.pt"
        dcp_to_torch_save(str(path), str(whole))
        full = torch.load(whole, map_location="cpu", weights_only=True)
    rest = torch.load(path / "meta.pt", map_location="cpu", weights_only=True)
    optimizers = []
    for i in range(len([k for k in full if k.startswith("optimizer_")])):
        osd = full[f"optimizer_{i}"]
        if "param_groups" not in osd:
            optimizers.append(unflatten_optimizer(osd))
            continue
        groups = [dict(g) for g in osd["param_groups"]]
        optimizers.append({"state": dict(osd["state"]), "groups": groups})
    return Portable(model=full["state_dict"], optimizers=optimizers, rest=rest)


def unflatten_optimizer(flat: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state saved per parameter ('state.<name>.<key>', 'param_groups.<name>.<key>',
    as pipeline stages write it) in the portable form; parameters with the same settings form
    one group."""
    state: dict[str, dict[str, Any]] = {}
    settings: dict[str, dict[str, Any]] = {}
    for key, value in flat.items():
        section, _, rest = key.partition(".")
        name, _, field = rest.rpartition(".")
        (state if section == "state" else settings).setdefault(name, {})[field] = value
    groups: list[dict[str, Any]] = []
    for name, values in settings.items():
        group = next((g for g in groups if _same(g, values)), None)
        if group is None:
            group = {**values, "params": []}
            groups.append(group)
        group["params"].append(name)
    return {"state": state, "groups": groups}


def _same(group: dict[str, Any], values: dict[str, Any]) -> bool:
    keys = set(group) - {"params"}
    return keys == set(values) and all(str(group[k]) == str(values[k]) for k in keys)


def read_deepspeed(path: Path) -> Portable:
    """Merge the per-rank ZeRO partitions (stage 1, 2 or 3) of a DeepSpeed checkpoint."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch

    root = path / (path / "latest").read_text().strip() if (path / "latest").exists() else path
    # zero_pp_rank_{r}_mp_rank_00_optim_states.pt; mp_rank_00_model_states.pt (stage 1/2) or
    # zero_pp_rank_{r}_mp_rank_00_model_states.pt (stage 3, all holding the client state)
    optim_files = sorted(root.glob("*_optim_states.pt"), key=_rank_of)
    model_files = sorted(root.glob("*model_states.pt"), key=_rank_of)
    if not optim_files or not model_files:
        raise NotPortable(f"{root} holds no DeepSpeed ZeRO partitions")
    with torch.serialization.safe_globals(deepspeed_globals()):  # data only, and these
        states = [
            torch.load(f, map_location="cpu", weights_only=True)["optimizer_state_dict"]
            for f in optim_files
        ]
        model_state = torch.load(model_files[0], map_location="cpu", weights_only=True)
    world = len(states)
    stage = int(states[0]["zero_stage"])
    if stage == 3:
        base = states[0]["optimizer_state_dict"]
        flats = [s["fp32_flat_groups"] for s in states]
        per_rank_state = [s["optimizer_state_dict"]["state"] for s in states]
    else:
        base = states[0]["base_optimizer_state"]
        flats = [s["single_partition_of_fp32_groups"] for s in states]
        per_rank_state = [s["base_optimizer_state"]["state"] for s in states]
    shapes = model_state["param_shapes"]
    strip = _strip_prefix

    def split(flat_parts: list[torch.Tensor], sub: int) -> dict[str, torch.Tensor]:
        """Full tensors of sub-group `sub` from its per-rank partitions."""
        out = {}
        if stage == 3:  # every parameter partitioned on its own, padded to a multiple of world
            offset = 0
            for name, shape in shapes[sub].items():
                numel = math.prod(shape)
                part = math.ceil(numel / world)
                pieces = [f.narrow(0, offset, part) for f in flat_parts]
                out[strip(name)] = torch.cat(pieces)[:numel].view(shape).clone()
                offset += part
        else:  # the group flattened whole, then cut into equal partitions (padding at the end)
            whole = torch.cat(flat_parts)
            offset = 0
            for name, shape in shapes[sub].items():
                numel = math.prod(shape)
                out[strip(name)] = whole.narrow(0, offset, numel).view(shape).clone()
                offset += numel
            if offset > whole.numel():
                raise NotPortable("its ZeRO partitions are smaller than the recorded shapes")
        return out

    model: dict[str, Any] = {}
    opt_state: dict[str, dict[str, Any]] = {}
    groups = []
    for group in base["param_groups"]:
        names: list[str] = []
        for sub in group["params"]:
            model.update(split([f[sub] for f in flats], sub))
            names += [strip(n) for n in shapes[sub]]
            keys = per_rank_state[0].get(sub, {})
            for key, value in keys.items():
                if isinstance(value, torch.Tensor) and value.dim() == 1:
                    full = split([s[sub][key] for s in per_rank_state], sub)
                    for name, tensor in full.items():
                        opt_state.setdefault(name, {})[key] = tensor
                else:  # a scalar shared by the group (Adam's step)
                    for name in shapes[sub]:
                        opt_state.setdefault(strip(name), {})[key] = copy_value(value)
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": names})
    buffers = set(model_state.get("buffer_names", []))
    for name, value in model_state["module"].items():
        if name in buffers:
            model[strip(name)] = value
    for alias, source in model_state.get("shared_params", {}).items():  # tied weights
        model[strip(alias)] = model[strip(source)]
    if model_state.get("frozen_param_shapes"):
        raise NotPortable("it holds frozen parameters, which ZeRO stores outside its partitions")
    rest = {k: v for k, v in model_state.items() if k not in DEEPSPEED_KEYS}
    return Portable(model=model, optimizers=[{"state": opt_state, "groups": groups}], rest=rest)


def _rank_of(path: Path) -> int:
    parts = path.name.split("_")
    return int(parts[3]) if parts[0] == "zero" else -1


def _strip_prefix(name: str) -> str:
    return name.removeprefix(WRAPPER_PREFIX)


def copy_value(value: Any) -> Any:
    return value.clone() if hasattr(value, "clone") else value


def group_of(portable_groups: list[dict[str, Any]], names: list[str]) -> dict[str, Any]:
    """The hyperparameters of the saved param group holding these parameters."""
    for group in portable_groups:
        if set(names) & set(group["params"]):
            return {k: v for k, v in group.items() if k != "params"}
    raise NotPortable(f"no saved param group holds {names[:3]}")


def indexed_state(optimizer, saved: dict[str, Any], names: dict[int, str]) -> dict[str, Any]:
    """A name-keyed optimizer state in the positional form `optimizer.load_state_dict` takes."""
    state, groups, index = {}, [], 0
    for group in optimizer.param_groups:
        group_names = [names[id(p)] for p in group["params"]]
        ids = list(range(index, index + len(group_names)))
        groups.append({**group_of(saved["groups"], group_names), "params": ids})
        state.update(
            {
                i: saved["state"][n]
                for i, n in zip(ids, group_names, strict=True)
                if n in saved["state"]
            }
        )
        index += len(ids)
    return {"state": state, "param_groups": groups}
