"""The one FSDP2 applier, used by every layout of the parallel strategy.

Sharding units, innermost first: the blocks (the modules of the classes named in `shard_modules`,
else those a transformers model names in `_no_split_modules`, else every member of an
`nn.ModuleList`), then the roots that take every parameter left over.
Without a pipeline the roots are the task's top-level children that hold parameters (embeddings,
heads); under a pipeline they are this rank's stage modules, so each stage all-gathers its own
leftovers when it runs and torch's pipeline stages drive its gradient reduction.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from framework.parallel.transforms import layers


@dataclass(frozen=True)
class FSDPSettings:
    """How FSDP2 shards (the `fully_shard` arguments a user can choose)."""

    reshard_after_forward: bool = True
    param_dtype: str | None = None
    reduce_dtype: str | None = None
    cpu_offload: bool = False
    shard_modules: tuple[str, ...] = ()


def blocks(task: nn.Module, class_names: tuple[str, ...] | list[str]) -> list[nn.Module]:
    """The block-level units: modules of the named classes, else the task's layers (a
    transformers model's decoder layers, else every ModuleList member)."""
    if class_names:
        return [m for m in task.modules() if type(m).__name__ in class_names]
    return layers(task)


def units(task: nn.Module, class_names: tuple[str, ...] | list[str] = ()) -> list[nn.Module]:
    """Sharding units, innermost first: the blocks, then the task's top-level children.

    The top-level children always close the set, so every parameter belongs to a unit and has
    its gradient reduced (embeddings and heads outside the blocks included).
    """
    depth = {m: name.count(".") + 1 for name, m in task.named_modules() if name}
    tops = list(task.children())
    chosen = {m: None for m in blocks(task, class_names) + tops if _has_parameters(m)}
    return sorted(chosen, key=lambda m: -depth[m])


def check_direct_parameters(task: nn.Module) -> None:
    own = [name for name, _ in task.named_parameters(recurse=False)]
    if own:
        raise ValueError(
            f"FSDP shards the task's submodules, but {type(task).__name__} holds "
            f"parameters directly: {', '.join(own)}. Move them into a submodule (e.g. nn.Module)."
        )


def fully_shard_kwargs(mesh, settings: FSDPSettings) -> dict:
    import torch
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    kwargs = {"mesh": mesh, "reshard_after_forward": settings.reshard_after_forward}
    if settings.param_dtype or settings.reduce_dtype:
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=getattr(torch, settings.param_dtype) if settings.param_dtype else None,
            reduce_dtype=getattr(torch, settings.reduce_dtype) if settings.reduce_dtype else None,
        )
    if settings.cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    return kwargs


def apply_fsdp(
    task: nn.Module,
    mesh,
    settings: FSDPSettings,
    roots: list[nn.Module] | None = None,
    ignored: set[nn.Parameter] | None = None,
) -> list[nn.Module]:
    """Shard `task` in place over `mesh` (1-D: shard; 2-D: replicate x shard). With `roots`
    (pipeline stages), the blocks inside them and then each root; `ignored` parameters (expert
    parallel's) are left whole. Returns the units."""
    from torch.distributed.fsdp import fully_shard

    if roots is None:
        check_direct_parameters(task)
        chosen = units(task, settings.shard_modules)
    else:
        inside = {id(p) for r in roots for p in r.parameters()}
        depth = {m: name.count(".") for name, m in task.named_modules()}
        inner = [
            m
            for m in blocks(task, settings.shard_modules)
            if _has_parameters(m) and all(id(p) in inside for p in m.parameters())
        ]
        chosen = sorted(inner, key=lambda m: -depth[m]) + list(roots)
    kwargs = fully_shard_kwargs(mesh, settings)
    if ignored:
        kwargs["ignored_params"] = set(ignored)
    for module in chosen:
        fully_shard(module, **kwargs)
    return chosen


def _has_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def shard_experts(task: nn.Module, mesh, settings: FSDPSettings) -> int:
    """FSDP2 over `mesh` (efsdp: the ranks holding the same experts) for every MoE layer's
    experts, already split over `ep`: their gradients are averaged over those ranks (the
    strategy then divides them by ep, see framework.parallel.experts)."""
    from torch.distributed.fsdp import fully_shard

    from framework.parallel.experts import moe_layers

    kwargs = fully_shard_kwargs(mesh, settings)
    layers = moe_layers(task)
    for moe in layers:
        fully_shard(moe.experts, **kwargs)
    return len(layers)
