"""Full (unsharded) states into DTensor-sharded models and optimizers, and back."""

from __future__ import annotations

import contextlib

from framework.checkpoint import portable


@contextlib.contextmanager
def without_empty_groups(optimizers):
    """Hide param groups with no parameters on this rank while torch's state-dict functions run
    (they fail on one). A pipeline stage can own no parameter of a group (e.g. no biases).
    Loading replaces the optimizer's group dicts: the hidden ones go back between the new ones."""
    empty = [
        [(i, g) for i, g in enumerate(opt.param_groups) if not g["params"]] for opt in optimizers
    ]
    for opt in optimizers:
        opt.param_groups = [g for g in opt.param_groups if g["params"]]
    try:
        yield
    finally:
        for opt, hidden in zip(optimizers, empty, strict=True):
            groups = list(opt.param_groups)
            for i, group in hidden:
                groups.insert(i, group)
            opt.param_groups = groups


def load_full_state(model, optimizers, state: portable.Portable, names: dict[int, str]) -> None:
    """Copy a full, name-keyed state (framework.checkpoint.portable) into FSDP2 / tensor-parallel shards.

    `names` maps id(parameter) to its name in `model`, for matching optimizer param groups.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    options = StateDictOptions(full_state_dict=True, strict=True)
    set_model_state_dict(model, state.model, options=options)
    with without_empty_groups(optimizers):
        load_optimizers(model, optimizers, state, names, options)


def load_optimizers(model, optimizers, state: portable.Portable, names, options) -> None:
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    for optimizer, saved in zip(optimizers, state.optimizers, strict=True):
        groups = []
        for group in optimizer.param_groups:
            group_names = [names[id(p)] for p in group["params"]]
            groups.append(
                {**portable.group_of(saved["groups"], group_names), "params": group_names}
            )
        full = {"state": saved["state"], "param_groups": groups}
        set_optimizer_state_dict(model, optimizer, full, options=options)
