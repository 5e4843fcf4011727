"""States that each process keeps for itself under the strategies whose processes step their own
optimizer (diloco, hogwild): each process writes its own into the checkpoint, and the one state
another strategy (or another process count) resumes with is their mean, all-reduced tensor by
tensor. No process ever gathers another's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

FOLDER = "replicas"  # in a checkpoint directory: one file per process


def replica_file(ckpt_dir: Path, rank: int) -> Path:
    return Path(ckpt_dir) / FOLDER / f"rank{rank:05d}.pt"


def write_replica(ckpt_dir: Path, rank: int, state: Any) -> None:
    """This process's own state, in its own file of the checkpoint being written."""
    from framework import files

    path = replica_file(ckpt_dir, rank)
    path.parent.mkdir(exist_ok=True)
    files.write_atomic_with(path, lambda fh: torch.save(state, fh))


def read_replica(ckpt_dir: Path, rank: int, trusted: bool = False) -> Any:
    """This process's own state from a checkpoint (type-restricted: framework.checkpoint.safe)."""
    from framework.checkpoint import safe

    path = replica_file(ckpt_dir, rank)
    return safe.load_torch(path, f"{Path(ckpt_dir).name}/{FOLDER}/{path.name}", trusted=trusted)


def mean_states(optimizers: list[torch.optim.Optimizer]) -> list[dict[str, Any]]:
    """Each optimizer's state dict with every floating-point tensor averaged over the processes
    (a momentum buffer averaged is ddp's: the mean of the gradients it accumulates), one tensor
    at a time: each process holds its own state and one more copy of it, never another's. Every
    process calls it (collectives)."""
    size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    states = []
    for optimizer in optimizers:
        saved = optimizer.state_dict()
        per_param = {}
        for index, entry in saved["state"].items():
            per_param[index] = {
                key: _mean(value, size)
                if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim()
                else value
                for key, value in entry.items()
            }
        states.append({**saved, "state": per_param})
    return states


def _mean(tensor: torch.Tensor, size: int) -> torch.Tensor:
    total = tensor.detach().clone()
    if size > 1:
        dist.all_reduce(total)
        total /= size
    return total.cpu()
