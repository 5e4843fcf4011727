"""Loading a checkpoint written in another layout into this strategy (imports Lightning, torch).

`PortableResume` is mixed into each strategy. When the worker finds that the checkpoint it resumes
from was written by another strategy or process count, it sets `portable_from`; the strategy then
reads the checkpoint's full state (`framework.portable`) and copies it into its own sharding:
whole tensors for ddp, this rank's ZeRO partitions for DeepSpeed, DTensor shards for fsdp.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

from framework import portable


class PortableResume:
    portable_from: Path | None = None
    checkpoint_format = "lightning"

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict:
        if self.portable_from is None:
            return super().load_checkpoint(checkpoint_path, weights_only)  # type: ignore[misc]
        state = portable.read(self.portable_from)
        self.load_portable(state)
        return state.rest

    def load_portable(self, state: portable.Portable) -> None:
        raise NotImplementedError

    def parameter_names(self) -> dict[int, str]:
        return {id(p): n for n, p in self.lightning_module.named_parameters()}  # type: ignore[attr-defined]


def indexed_state(optimizer, saved: dict[str, Any], names: dict[int, str]) -> dict[str, Any]:
    """A name-keyed optimizer state in the positional form `optimizer.load_state_dict` takes."""
    state, groups, index = {}, [], 0
    for group in optimizer.param_groups:
        group_names = [names[id(p)] for p in group["params"]]
        ids = list(range(index, index + len(group_names)))
        groups.append({**portable.group_of(saved["groups"], group_names), "params": ids})
        state.update(
            {
                i: saved["state"][n]
                for i, n in zip(ids, group_names, strict=True)
                if n in saved["state"]
            }
        )
        index += len(ids)
    return {"state": state, "param_groups": groups}


class Replicated(PortableResume):
    """ddp (and one process): the model is loaded before setup, the optimizer after it."""

    def load_portable(self, state: portable.Portable) -> None:
        state.rest["state_dict"] = state.model
        state.rest["optimizer_states"] = (
            state.optimizers
        )  # keyed by name until the optimizer exists

    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        if self.portable_from is None:
            return super().load_optimizer_state_dict(checkpoint)  # type: ignore[misc]
        names = self.parameter_names()
        for optimizer, saved in zip(self.optimizers, checkpoint["optimizer_states"], strict=True):  # type: ignore[attr-defined]
            optimizer.load_state_dict(indexed_state(optimizer, saved, names))


class PortableDDP(Replicated, DDPStrategy):
    pass


class PortableSingleDevice(Replicated, SingleDeviceStrategy):
    pass


def load_into_zero(strategy, state: portable.Portable) -> None:
    """Copy full tensors into this rank's ZeRO partitions (stage 1, 2 or 3), padding skipped."""
    import torch.distributed as dist
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    ds_opt = strategy.deepspeed_engine.optimizer
    base = ds_opt.optimizer
    names = strategy.parameter_names()
    saved = state.optimizers[0]
    stage3 = hasattr(ds_opt, "fp32_partitioned_groups_flat")
    if stage3:
        flats, lp_groups = ds_opt.fp32_partitioned_groups_flat, ds_opt.fp16_groups
    else:
        flats, lp_groups = ds_opt.single_partition_of_fp32_groups, ds_opt.bit16_groups
    lp_of = {id(flat): lps for flat, lps in zip(flats, lp_groups, strict=True)}
    # Stage 3 puts its flat partitions (one per sub-group) into the param groups only during
    # the step; stages 1 and 2 have one flat partition per param group.
    owner = ds_opt.sub_group_to_group_id if stage3 else dict(enumerate(range(len(flats))))
    # The optimizer state starts lazily (first step): create it, then fill it.
    for index, group in enumerate(base.param_groups):
        mine = [flats[s] for s in range(len(flats)) if owner[s] == index]
        group_names = [names[id(p)] for flat in mine for p in lp_of[id(flat)]]
        group.update(portable.group_of(saved["groups"], group_names))
        for flat in mine:
            first = saved["state"].get(names[id(lp_of[id(flat)][0])], {})
            slot = base.state[flat]
            for key, value in first.items():
                elementwise = isinstance(value, torch.Tensor) and value.dim() > 0
                slot[key] = torch.zeros_like(flat) if elementwise else portable.copy_value(value)
    tensor_keys = [
        k
        for k, v in next(iter(saved["state"].values()), {}).items()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    ]
    if not stage3:
        ds_opt._hp_optimizer_states_linked = False
        ds_opt._lazy_init_hp_params_optimizer_state()
        for p in (p for lps in lp_groups for p in lps):
            name = names[id(p)]
            full = state.model[name].to(p.dtype)
            p.data.copy_(full)
            safe_set_full_fp32_param(p, state.model[name].float())
            for key in tensor_keys:
                safe_set_full_optimizer_state(p, saved["state"][name][key].float(), key)
        return
    rank = dist.get_rank(group=ds_opt.dp_process_group)
    for sub, lps in enumerate(lp_groups):
        flat = flats[sub]
        for p in lps:
            name = names[id(p)]
            _, offset, count = ds_opt.grad_position[ds_opt.get_param_id(p)]
            part = p.ds_tensor.numel()
            full = state.model[name]
            flat.data.narrow(0, offset, count).copy_(_partition(full.float(), part, rank)[:count])
            p.ds_tensor.data.copy_(_partition(full, part, rank).to(p.ds_tensor.dtype))
            if p.data.numel() == full.numel():  # a persistent (never partitioned) parameter
                p.data.copy_(full.view_as(p.data))
            for key in tensor_keys:
                value = _partition(saved["state"][name][key].float(), part, rank)[:count]
                base.state[flat][key].narrow(0, offset, count).copy_(value)


def _partition(value: torch.Tensor, part: int, rank: int) -> torch.Tensor:
    """This rank's ZeRO-3 partition of a full tensor (zero padding past its end)."""
    padded = torch.zeros(part * (rank + 1), dtype=value.dtype)
    n = min(value.numel(), padded.numel())
    padded[:n] = value.flatten()[:n]
    return padded.narrow(0, part * rank, part)


def load_into_fsdp(strategy, state: portable.Portable) -> None:
    """Full tensors into FSDP2's DTensor shards (model and optimizer)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, strict=True)
    set_model_state_dict(strategy.model, state.model, options=options)
    names = strategy.parameter_names()
    for optimizer, saved in zip(strategy.optimizers, state.optimizers, strict=True):
        groups = []
        for group in optimizer.param_groups:
            group_names = [names[id(p)] for p in group["params"]]
            groups.append(
                {**portable.group_of(saved["groups"], group_names), "params": group_names}
            )
        full = {"state": saved["state"], "param_groups": groups}
        set_optimizer_state_dict(strategy.model, optimizer, full, options=options)
