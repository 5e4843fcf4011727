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

from framework.nn.transforms import list_members
from framework.strategies._portable import PortableResume, load_into_fsdp


class FSDP2Strategy(PortableResume, ModelParallelStrategy):
    """FSDP2 over all processes (a 1-D mesh), applied per sharding unit of the task."""

    strategy_name = "fw_fsdp2"
    checkpoint_format = "dcp"  # torch.distributed.checkpoint shards plus Lightning's meta.pt

    def __init__(self, cfg, world) -> None:
        super().__init__(
            data_parallel_size=world.world_size,
            tensor_parallel_size=1,
            **process_group_args(cfg, world),
        )
        self.cfg = cfg

    def load_portable(self, state) -> None:
        load_into_fsdp(self, state)

    def setup(self, trainer) -> None:
        self.accelerator.setup(trainer)
        shard(self.lightning_module, self.device_mesh["data_parallel"], self.cfg)
        finish_setup(self, trainer)


def process_group_args(cfg, world) -> dict:
    """ModelParallelStrategy's arguments shared by the DTensor strategies: sharded DCP
    checkpoints, the collective backend and timeout."""
    return {
        "save_distributed_checkpoint": True,
        "process_group_backend": cfg.backend or ("nccl" if world.is_cuda else "gloo"),
        "timeout": timedelta(seconds=cfg.timeout_s),
    }


def finish_setup(strategy: ModelParallelStrategy, trainer) -> None:
    """After the model is sharded in place: precision, optimizers (when fitting), devices."""
    strategy.model = strategy.precision_plugin.convert_module(strategy.model)
    strategy.barrier()
    fitting = trainer.state.fn == TrainerFn.FITTING
    if fitting:
        strategy.setup_optimizers(trainer)
    strategy.setup_precision_plugin()
    if fitting:
        _optimizers_to_device(strategy.optimizers, strategy.root_device)


def units(task: nn.Module, class_names: list[str]) -> list[nn.Module]:
    """Sharding units, innermost first: the blocks, then the task's top-level children.

    Blocks are the modules of the named classes, or else every member of an `nn.ModuleList`.
    The top-level children always close the set, so every parameter belongs to a unit and
    has its gradient reduced (embeddings and heads outside the blocks included).
    """
    depth = {m: name.count(".") + 1 for name, m in task.named_modules() if name}
    if class_names:
        blocks = [m for m in depth if type(m).__name__ in class_names]
    else:
        blocks = list_members(task)
    tops = list(task.children())
    chosen = {m: None for m in blocks + tops if any(True for _ in m.parameters())}
    return sorted(chosen, key=lambda m: -depth[m])


def check_direct_parameters(task: nn.Module) -> None:
    own = [name for name, _ in task.named_parameters(recurse=False)]
    if own:
        raise ValueError(
            f"strategy=fsdp shards the task's submodules, but {type(task).__name__} holds "
            f"parameters directly: {', '.join(own)}. Move them into a submodule (e.g. nn.Module)."
        )


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
    check_direct_parameters(task)
    for module in units(task, list(cfg.shard_modules)):
        fully_shard(module, **kwargs)
