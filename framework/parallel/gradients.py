"""Gradients over the mesh: making them whole, summing tied copies, and their global norm.

All functions take the parameters (or gradients) they act on and the process groups they need;
none reads the strategy or the config.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist


def local(tensor):
    """A DTensor's local shard, or the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def reduce_partial_gradients(params: Iterable[torch.nn.Parameter]) -> None:
    """Sum, once per step, gradients that are still partial sums over tensor-parallel ranks.

    Under sequence parallelism a norm's weight (or a row-split linear's bias) sees only this
    rank's positions, so its gradient is a DTensor holding a partial sum. Left so, every optimizer
    op that reads it would all-reduce it again; here it is all-reduced once after backward.
    """
    from torch.distributed.tensor import DTensor, Partial, Replicate

    for param in params:
        grad = param.grad
        if isinstance(grad, DTensor) and any(isinstance(p, Partial) for p in grad.placements):
            placements = [Replicate() if isinstance(p, Partial) else p for p in grad.placements]
            param.grad = grad.redistribute(grad.device_mesh, placements)


def match_parameter_layout(params: Iterable[torch.nn.Parameter]) -> None:
    """Give every DTensor gradient its parameter's placements (a pipeline stage's backward can
    leave a tensor-parallel gradient laid out otherwise)."""
    for p in params:
        grad = p.grad
        if hasattr(grad, "placements") and grad.placements != p.placements:
            p.grad = grad.redistribute(p.device_mesh, p.placements)


def squared_norm(grads: Iterable[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The sum of squares of the full gradients (float64), the same on every rank that holds
    them: a DTensor's local squares are summed over the mesh dimensions it is sharded on, never
    over those it is replicated on."""
    from torch.distributed.tensor import DTensor, Partial

    total = torch.zeros((), device=device, dtype=torch.float64)
    groups: dict[tuple, torch.Tensor] = {}
    for grad in grads:
        if isinstance(grad, DTensor):
            if any(isinstance(p, Partial) for p in grad.placements):
                raise ValueError("a gradient is still a partial sum; reduce it first")
            key = (
                grad.device_mesh,
                tuple(i for i, p in enumerate(grad.placements) if p.is_shard()),
            )
            # `.to(device)`: FSDP's CPU offload keeps gradient shards on the CPU, and the
            # collective below runs on the group's device
            part = grad.to_local().double().pow(2).sum().to(device)
            groups[key] = groups.get(key, torch.zeros_like(total)) + part
        else:
            total += grad.double().pow(2).sum().to(device)
    for (mesh, sharded), part in groups.items():
        for dim in sharded:
            dist.all_reduce(part, group=mesh.get_group(dim))
        total += part
    return total


def clip_by_total_norm(
    params: list[torch.nn.Parameter],
    max_norm: float,
    device: torch.device,
    skip: set[int] = frozenset(),
    stage_group=None,
) -> torch.Tensor:
    """Like torch's clip_grad_norm_, over every parameter of the model wherever it lives.

    `skip` (ids) are copies counted elsewhere (a tied weight held by two pipeline ranks);
    `stage_group` sums the norms of the pipeline's stages (None: no pipeline). Returns the norm.
    """
    grads = [p.grad for p in params if p.grad is not None and id(p) not in skip]
    total = squared_norm(grads, device)
    if stage_group is not None:
        dist.all_reduce(total, group=stage_group)
    norm = total.sqrt()
    scale = torch.clamp(float(max_norm) / (norm + 1e-6), max=1.0)
    for p in params:
        if p.grad is not None:
            grad = local(p.grad)  # on the CPU under FSDP's CPU offload: the scale goes there
            grad.mul_(scale.to(grad.device, grad.dtype))
    return norm


def sum_tied(params: list[torch.nn.Parameter], group) -> None:
    """Each of `params` is one copy of a weight tied across pipeline ranks: all get the sum."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(local(p.grad), group=group)
