"""The Lightning strategy behind `strategy=fsdp` (imports Lightning and torch.distributed.fsdp).

Lightning's ModelParallelStrategy asks the task to shard itself in `configure_model`; this one
shards any task, so a task written for ddp runs unchanged.
"""

from __future__ import annotations

from datetime import timedelta

import torch
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn


class FSDP2Strategy(ModelParallelStrategy):
    """FSDP2 over all processes (a 1-D mesh), applied per sharding unit of the task."""

    strategy_name = "fw_fsdp2"
    checkpoint_format = "dcp"  # torch.distributed.checkpoint shards plus Lightning's meta.pt

    def __init__(self, cfg, world) -> None:
        super().__init__(
            data_parallel_size=world.world_size,
            tensor_parallel_size=1,
            save_distributed_checkpoint=True,
            process_group_backend=cfg.backend or ("nccl" if world.is_cuda else "gloo"),
            timeout=timedelta(seconds=cfg.timeout_s),
        )
        self.cfg = cfg

    def setup(self, trainer) -> None:
        self.accelerator.setup(trainer)
        shard(self.lightning_module, self.device_mesh["data_parallel"], self.cfg)
        self.model = self.precision_plugin.convert_module(self.model)
        self.barrier()
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)


def units(task: nn.Module, class_names: list[str]) -> list[nn.Module]:
    """Sharding units, innermost first: blocks, then the task's top-level children."""
    if class_names:
        return [m for m in task.modules() if type(m).__name__ in class_names and m is not task]
    found = []
    for module in task.modules():
        if isinstance(module, nn.ModuleList):
            found.extend(m for m in module if any(True for _ in m.parameters()))
    found.extend(m for m in task.children() if any(True for _ in m.parameters()))
    return found


def shard(task: nn.Module, mesh, cfg) -> None:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    kwargs = {"mesh": mesh, "reshard_after_forward": cfg.reshard_after_forward}
    if cfg.param_dtype or cfg.reduce_dtype:
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=getattr(torch, cfg.param_dtype) if cfg.param_dtype else None,
            reduce_dtype=getattr(torch, cfg.reduce_dtype) if cfg.reduce_dtype else None,
        )
    if cfg.cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for module in units(task, list(cfg.shard_modules)):
        fully_shard(module, **kwargs)
