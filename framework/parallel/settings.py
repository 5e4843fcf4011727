"""What the parallel strategy hands `parallelize`, derived from its config: one function used by
the strategy's setup (`fw train`) and by the simulation of `fw check` and `fw plan`, so the two
cannot disagree on a plan."""

from __future__ import annotations

from typing import Any

from torch import nn

from framework.parallel.dims import ParallelDims
from framework.parallel.fsdp import FSDPSettings
from framework.parallel.parallelize import StageCut, TensorParallelSettings


def tensor_plan(task: nn.Module, cfg: Any, dims: ParallelDims) -> dict[str, str]:
    """The config's plan entries; for a model that declares no plan of its own and is given
    none, the plan inferred from its structure (framework/parallel/infer.py; checked before
    launch to split something)."""
    from framework.parallel.infer import plan_for

    given = dict(str(e).rsplit(":", 1) for e in cfg.tp_plan)
    if given or dims.tp == 1:
        return given
    return plan_for(task, dims.tp).plan


def parallel_settings(
    task: nn.Module,
    cfg: Any,
    dims: ParallelDims,
    cut: StageCut | None,
    cpu_offload: bool | None = None,
) -> tuple[TensorParallelSettings, FSDPSettings]:
    """The tensor-parallel and FSDP settings of `cfg` (the strategy's config) for `task`;
    `cpu_offload` replaces the config's (the simulation counts offloaded states on the device:
    an upper bound)."""
    tensor = TensorParallelSettings(
        plan=tensor_plan(task, cfg, dims),
        sequence_parallel=cfg.sequence_parallel,
        loss_parallel=cfg.loss_parallel and cut is None,  # logits whole on a last stage
    )
    fsdp = FSDPSettings(
        reshard_after_forward=cfg.reshard_after_forward,
        param_dtype=cfg.param_dtype,
        reduce_dtype=cfg.reduce_dtype,
        cpu_offload=cfg.cpu_offload if cpu_offload is None else cpu_offload,
        shard_modules=tuple(cfg.shard_modules),
    )
    return tensor, fsdp
