"""The Lightning strategy behind `strategy=tensor|fsdp_tp` (imports Lightning and torch.distributed).

Lightning's ModelParallelStrategy knows two mesh dimensions and asks the task to parallelize itself
in `configure_model`. This one builds a (dp, fsdp, tp) mesh and applies the plans itself, so any
task built from `framework.nn` blocks (or declaring plans) runs unchanged.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.strategies.strategy import Strategy

from framework.nn.plan import apply_tensor_parallel
from framework.strategies._fsdp import (
    check_direct_parameters,
    finish_setup,
    process_group_args,
    units,
)
from framework.strategies._portable import PortableResume, load_into_fsdp
from framework.world import DP_RANK_ENV, DP_SIZE_ENV

NAMES = ("dp", "fsdp", "tp")


class MeshStrategy(PortableResume, ModelParallelStrategy):
    strategy_name = "fw_mesh"
    checkpoint_format = "dcp"

    def __init__(self, cfg, degrees: dict[str, int], world) -> None:
        super().__init__(
            data_parallel_size=degrees["dp"] * degrees["fsdp"],
            tensor_parallel_size=degrees["tp"],
            **process_group_args(cfg, world),
        )
        self.cfg = cfg
        self.degrees = degrees
        self.mesh = None
        self.model_transforms = None  # activation checkpointing and compile, set by the worker

    def setup_environment(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        Strategy.setup_environment(self)
        self._setup_distributed()
        shape = tuple(self.degrees[n] for n in NAMES)
        self.mesh = init_device_mesh(self.root_device.type, shape, mesh_dim_names=NAMES)
        data = self.mesh[("dp", "fsdp")]._flatten("data_parallel")
        # Lightning reads these two names (sampler, logging); the data loaders read the env.
        self._device_mesh = self.mesh
        self._data_mesh = data
        os.environ[DP_RANK_ENV] = str(data.get_local_rank())
        os.environ[DP_SIZE_ENV] = str(data.size())
        self.lightning_module._device_mesh = self.mesh

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self._data_mesh.size(), "rank": self._data_mesh.get_local_rank()}

    def loss_context(self):
        """torch's loss_parallel: cross-entropy on vocabulary-split logits, forward and backward."""
        if self.degrees["tp"] > 1 and self.cfg.loss_parallel:
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()
        return contextlib.nullcontext()

    def training_step(self, *args, **kwargs):
        with self.loss_context():
            return plain(super().training_step(*args, **kwargs))

    def validation_step(self, *args, **kwargs):
        with self.loss_context():
            return plain(super().validation_step(*args, **kwargs))

    def backward(self, closure_loss, optimizer, *args, **kwargs):
        with self.loss_context():
            return super().backward(closure_loss, optimizer, *args, **kwargs)

    def reduce(self, tensor, *args, **kwargs):
        # values a task logs from a loss_parallel loss are replicated DTensors
        return super().reduce(plain(tensor), *args, **kwargs)

    def post_backward(self, closure_loss) -> None:
        super().post_backward(closure_loss)
        if self.cfg.sequence_parallel:  # the only source of partial gradients here
            reduce_partial_gradients(self.lightning_module)

    def load_portable(self, state) -> None:
        load_into_fsdp(self, state)

    def setup(self, trainer) -> None:
        self.accelerator.setup(trainer)
        task = self.lightning_module
        if self.degrees["tp"] > 1:
            extra = dict(str(e).rsplit(":", 1) for e in self.cfg.tp_plan)
            apply_tensor_parallel(
                task,
                self.mesh["tp"],
                extra,
                sequence_parallel=self.cfg.sequence_parallel,
                loss_parallel=self.cfg.loss_parallel,
            )
        if self.model_transforms is not None:
            self.model_transforms.apply(task)
        if self.degrees["dp"] * self.degrees["fsdp"] > 1:
            shard_data_parallel(task, self.mesh, self.degrees, self.cfg)
        finish_setup(self, trainer)


def plain(output):
    """A step's loss as a plain tensor (loss_parallel returns a replicated DTensor)."""
    if hasattr(output, "to_local"):
        return output.to_local()
    if isinstance(output, dict) and hasattr(output.get("loss"), "to_local"):
        return {**output, "loss": output["loss"].to_local()}
    return output


def reduce_partial_gradients(module) -> None:
    """Sum, once per step, gradients that are still partial sums over the tensor-parallel ranks.

    Under sequence parallelism a norm's weight (or a row-split linear's bias) sees only this
    rank's positions, so its gradient is a DTensor holding a partial sum. Left so, every optimizer
    op that reads it would all-reduce it again; here it is all-reduced once after backward.
    """
    from torch.distributed.tensor import DTensor, Partial, Replicate

    for param in module.parameters():
        grad = param.grad
        if isinstance(grad, DTensor) and any(isinstance(p, Partial) for p in grad.placements):
            placements = [Replicate() if isinstance(p, Partial) else p for p in grad.placements]
            param.grad = grad.redistribute(grad.device_mesh, placements)


def shard_data_parallel(task, mesh, degrees: dict[str, int], cfg) -> None:
    """FSDP2 over the data-parallel dimensions: shard over fsdp, replicate over dp (hybrid)."""
    from torch.distributed.fsdp import fully_shard

    # with dp > 1 a 2-D mesh: FSDP2 replicates over dp and shards over fsdp (size 1: no sharding)
    data_mesh = mesh[("dp", "fsdp")] if degrees["dp"] > 1 else mesh["fsdp"]
    check_direct_parameters(task)
    for module in units(task, []):
        fully_shard(module, mesh=data_mesh, reshard_after_forward=cfg.reshard_after_forward)
