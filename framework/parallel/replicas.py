"""States that each process keeps for itself under the strategies whose processes step their own
optimizer (diloco, hogwild): gathered to rank 0 for a checkpoint, and averaged into the one
state another strategy resumes with."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def on_cpu(state: Any) -> Any:
    """A copy of a nested state with every tensor in CPU memory (for pickling to rank 0)."""
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {k: on_cpu(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(on_cpu(v) for v in state)
    return state


def mean_state(states: tuple[dict[str, Any], ...]) -> dict[str, Any]:
    """One optimizer's state dict with each floating-point tensor averaged over the processes'
    (a momentum buffer averaged is ddp's: the mean of the gradients it accumulates)."""
    first = states[0]
    per_param = {}
    for index, entry in first["state"].items():
        per_param[index] = {
            key: torch.stack([s["state"][index][key] for s in states]).mean(0)
            if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim()
            else value
            for key, value in entry.items()
        }
    return {**first, "state": per_param}


def gather_to_zero(state: Any) -> list[Any] | None:
    """Every process's `state` on rank 0, in rank order (None elsewhere)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [state]
    rank = dist.get_rank()
    out: list[Any] | None = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(state, out, dst=0)
    return out
