"""Full (unsharded) states into DTensor-sharded models and optimizers, and back."""

from __future__ import annotations

from framework import portable


def load_full_state(model, optimizers, state: portable.Portable, names: dict[int, str]) -> None:
    """Copy a full, name-keyed state (framework.portable) into FSDP2 / tensor-parallel shards.

    `names` maps id(parameter) to its name in `model`, for matching optimizer param groups.
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, strict=True)
    set_model_state_dict(model, state.model, options=options)
    for optimizer, saved in zip(optimizers, state.optimizers, strict=True):
        groups = []
        for group in optimizer.param_groups:
            group_names = [names[id(p)] for p in group["params"]]
            groups.append(
                {**portable.group_of(saved["groups"], group_names), "params": group_names}
            )
        full = {"state": saved["state"], "param_groups": groups}
        set_optimizer_state_dict(model, optimizer, full, options=options)
