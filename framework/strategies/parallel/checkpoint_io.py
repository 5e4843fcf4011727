"""Checkpoints of the parallel strategy: DCP directories, read and written by parameter name.

Without a pipeline they are Lightning's DCP layout (`dcp`). Under a pipeline each stage saves
only its own parameters, so the optimizer state is keyed per parameter name (`dcp_flat`): any
split, any pp, or no pipeline at all reads it back. A full state from another layout is copied
into the shards; a tied weight is found under whichever of its names the checkpoint has.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from framework.checkpoint import portable
from framework.parallel.state import load_full_state, without_empty_groups

FLAT = {"flatten_optimizer_state_dict": True}


def flat_optimizer_state(model, optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    options = StateDictOptions(cpu_offload=True, **FLAT)
    return get_optimizer_state_dict(model, optimizer, options=options)


def load_flat(model, optimizers, path: Path, weights_only: bool | None) -> dict:
    """Load a `dcp_flat` directory written by the same layout; returns Lightning's rest."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    options = StateDictOptions(**FLAT)
    state = {"state_dict": get_model_state_dict(model)}
    with without_empty_groups(optimizers):
        for i, opt in enumerate(optimizers):
            state[f"optimizer_{i}"] = get_optimizer_state_dict(model, opt, options=options)
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(model, state["state_dict"])
        for i, opt in enumerate(optimizers):
            set_optimizer_state_dict(model, opt, state[f"optimizer_{i}"], options=options)
    return torch.load(path / "meta.pt", map_location="cpu", weights_only=bool(weights_only))


def with_aliases(state: portable.Portable, own: set[str], aliases) -> portable.Portable:
    """The full state with every name this model uses, a tied weight looked up under any of
    its names (`aliases(name)` lists them)."""
    model = {}
    for name in own:
        found = next((n for n in aliases(name) if n in state.model), name)
        model[name] = state.model[found]
    optimizers = []
    for saved in state.optimizers:
        renamed = dict(saved["state"])
        groups = [dict(g) for g in saved["groups"]]
        for name in own:
            for alias in aliases(name):
                if alias in saved["state"] and name not in renamed:
                    renamed[name] = saved["state"][alias]
                    for g in groups:
                        if alias in g["params"]:
                            g["params"] = [*g["params"], name]
        optimizers.append({"state": renamed, "groups": groups})
    return portable.Portable(model, optimizers, state.rest)


def load_portable(model, optimizers, state: portable.Portable, names, aliases=None) -> None:
    """A full state (any layout) into this rank's shards (and stages)."""
    if aliases is not None:
        state = with_aliases(state, set(model.state_dict()), aliases)
    load_full_state(model, optimizers, state, names)
