"""Expert parallel: each rank of the `ep` view keeps E/ep of every MoE layer's experts, and the
routers' load is balanced once per optimizer step.

The stacked expert weights become DTensors sharded on dim 0 (the expert dimension) over the
`ep` view, so checkpoints hold them whole, by name, for any ep. Every rank built the whole model
from the seed, so each takes its slice without communication.

Gradients: a rank's expert gradient sums what every rank of its ep group routed to it (each
rank's loss being the mean over its own tokens). The gradient of the global mean loss is that
sum, summed over `efsdp` (the ranks holding the same experts) and divided by all D = ep x efsdp
data-parallel ranks. FSDP2 shards the experts over efsdp (when it has more than one rank) and
averages their gradients over it; dividing the result by ep once per optimizer step completes
the D (`scale_expert_gradients`). So the expert gradients are the same for any ep (the trap
DeepSpeed #5618 describes).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def moe_layers(model: nn.Module) -> list[nn.Module]:
    """The mixture-of-experts layers of a model (framework.nn.moe.MoE, and a model family's MoE
    blocks once its adapter has swapped them), in module order."""
    from framework.nn.moe import ExpertDispatch

    return [m for m in model.modules() if isinstance(m, ExpertDispatch)]


def apply_expert_parallel(model: nn.Module, ep_mesh) -> set[nn.Parameter]:
    """Keep this rank's experts of every MoE layer (as Shard(0) DTensors over `ep_mesh`) and give
    each layer its all-to-all group; returns the expert parameters (for FSDP to ignore).
    A model family's MoE blocks (transformers' sparse ones) are swapped for framework layers
    first (the parallel strategy did it already, before its callbacks' setup; fw check's
    simulation does it here)."""
    from torch.distributed.tensor import DTensor, Shard

    from framework.parallel.model import adapter_for

    size, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    adapter_for(model).swap_experts(model, size)
    experts: set[nn.Parameter] = set()
    for moe in moe_layers(model):
        moe.set_expert_parallel(ep_mesh.get_group(), size, rank)
        for name in moe.experts.weight_names:
            full = getattr(moe.experts, name)
            mine = full.detach().chunk(size, dim=0)[rank].clone()
            param = nn.Parameter(DTensor.from_local(mine, ep_mesh, [Shard(0)], run_check=False))
            setattr(moe.experts, name, param)
            experts.add(param)
    return experts


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [getattr(m.experts, n) for m in moe_layers(model) for n in m.experts.weight_names]


def scale_expert_gradients(params: list[nn.Parameter], ep: int) -> None:
    """Divide the expert gradients by the expert-parallel degree (after FSDP's average over the
    ranks holding the same experts, or with no FSDP when there is one such rank)."""
    for p in params:
        if p.grad is not None:
            (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).div_(ep)


@torch.no_grad()
def balance_routers(model: nn.Module, data_group) -> None:
    """Once per optimizer step: every router's token counts since the last step, summed over the
    data-parallel ranks (`data_group`; None: all processes), move its expert bias towards equal
    load; the counts are kept as `global_counts` for the metrics."""
    balance(moe_layers(model), data_group)


def balance(layers: list[nn.Module], data_group) -> None:
    """`balance_routers` for MoE layers already found."""
    for moe in layers:
        router = moe.router
        counts = router.tokens_per_expert.clone()
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(counts, group=data_group)
        router.global_counts = counts
        router.update_bias(counts)
