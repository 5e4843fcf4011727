"""Applying tensor-parallel plans to a model (imports torch.distributed.tensor lazily)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def collect_plan(model: nn.Module) -> dict[str, Any]:
    """{absolute module name: ParallelStyle} from every module that declares `tp_plan()`."""
    plan: dict[str, Any] = {}
    for name, module in model.named_modules():
        own = getattr(type(module), "tp_plan", None)
        if own is None:
            continue
        for sub, style in module.tp_plan().items():
            full = ".".join(p for p in (name, sub) if p)
            plan[full] = style
    return plan


def apply_tensor_parallel(model: nn.Module, mesh, extra: dict[str, Any] | None = None) -> int:
    """Shard `model` in place over the 1-D tensor-parallel `mesh`; returns how many modules.

    Weights shared between modules (a head tied to its embedding) stay shared: the sharded
    parameter of the first module replaces the other's.
    """
    from torch.distributed.tensor.parallel import parallelize_module

    plan = {**collect_plan(model), **(extra or {})}
    if not plan:
        return 0
    ties = _shared_parameters(model)
    parallelize_module(model, mesh, plan)
    for owner, others in ties.items():
        shared = _get(model, owner)
        for other in others:
            module_name, _, attr = other.rpartition(".")
            setattr(model.get_submodule(module_name) if module_name else model, attr, shared)
    return len(plan)


def _shared_parameters(model: nn.Module) -> dict[str, list[str]]:
    first: dict[int, str] = {}
    ties: dict[str, list[str]] = {}
    for module_name, module in model.named_modules():
        for attr, param in module.named_parameters(recurse=False):
            name = f"{module_name}.{attr}" if module_name else attr
            if id(param) in first:
                ties.setdefault(first[id(param)], []).append(name)
            else:
                first[id(param)] = name
    return ties


def _get(model: nn.Module, name: str) -> nn.Parameter:
    module_name, _, attr = name.rpartition(".")
    return getattr(model.get_submodule(module_name) if module_name else model, attr)


def full_tensor(x: torch.Tensor) -> torch.Tensor:
    """A plain tensor from a DTensor (gathered), or `x` itself."""
    return x.full_tensor() if hasattr(x, "full_tensor") else x
