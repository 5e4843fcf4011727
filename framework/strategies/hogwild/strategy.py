"""The Lightning strategies behind `strategy=hogwild` (imports Lightning: workers only).

The task is not wrapped in DistributedDataParallel: no gradient is all-reduced. When fitting
starts, the parameters are moved into shared memory holding rank 0's values
(`shared.share_parameters`); each worker's optimizer then steps on its own gradients and writes
into that memory in place. Processes wait for each other only around validation (which then
sees one model, not one that other workers are changing) and around checkpoints.

A checkpoint is ddp's Lightning file with these differences:
- `state_dict` is the shared parameters, written once by rank 0 while every worker waits at a
  barrier after the same number of its own steps, so it holds exactly those steps of each;
- `optimizer_states` holds the workers' optimizer states averaged (what ddp, or any other
  strategy, resumes with);
- each worker writes its own optimizer state beside it (replicas/rankNNNNN.pt), nothing
  gathered on one rank.
Resuming with as many workers gives each its own state back (the checkpointer restores each
one's RNG and the data position); with another number each starts from the average.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from lightning.pytorch.trainer.states import TrainerFn

from framework.parallel.replicas import mean_states, read_replica, write_replica
from framework.strategies.hogwild.shared import share_parameters
from framework.strategy_base import Replicated

log = logging.getLogger("framework.hogwild")
KEY = "hogwild"  # the checkpoint's key for the workers' own optimizer states


class Hogwild(Replicated):
    """Workers that step the task's optimizer on their own gradients into shared parameters."""

    def __init__(self, cfg: Any, *args: Any, **kwargs: Any) -> None:
        self.cfg = cfg
        self.shared = False
        super().__init__(*args, **kwargs)

    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING and not self.shared:
            size = share_parameters(self.lightning_module, Path(self.cfg.shm_dir), self.global_rank)
            self.shared = True
            if self.is_global_zero:
                log.info(
                    "Hogwild: %d worker(s) update %.2f MiB of parameters in shared memory "
                    "without locks.",
                    self.world_size,
                    size / 2**20,
                )

    def on_validation_start(self) -> None:
        self.barrier("hogwild-validation-start")  # no worker is still training
        super().on_validation_start()

    def on_validation_end(self) -> None:
        super().on_validation_end()
        self.barrier("hogwild-validation-end")  # no worker trains before all have validated

    # ---- checkpoints
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options=None):
        if not self.shared:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        # Every worker has finished the same number of steps; none steps again until rank 0
        # has written the shared parameters (checkpoint["state_dict"] views them).
        self.barrier("hogwild-checkpoint")
        # each worker its own optimizer state in its own file; the mean for other layouts
        write_replica(
            Path(filepath).parent, self.global_rank, [o.state_dict() for o in self.optimizers]
        )
        checkpoint["optimizer_states"] = mean_states(self.optimizers)
        checkpoint[KEY] = {"workers": self.world_size}
        super().save_checkpoint(checkpoint, filepath, storage_options)
        self.barrier("hogwild-checkpoint-written")

    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        super().load_optimizer_state_dict(checkpoint)  # the average, or another layout's
        saved = checkpoint.get(KEY)
        if saved is None:
            return
        count = saved["workers"] if "workers" in saved else len(saved["optimizers"])
        if count != self.world_size:
            log.warning(
                "The checkpoint was written by %d hogwild workers, not %d: each starts from "
                "their mean optimizer state.",
                count,
                self.world_size,
            )
            return
        own = (
            saved["optimizers"][self.global_rank]
            if "optimizers" in saved  # written by an earlier version, gathered
            else read_replica(self.checkpoint_dir, self.global_rank, self.inputs.trust_checkpoint)
        )
        for optimizer, state in zip(self.optimizers, own, strict=True):
            optimizer.load_state_dict(state)


class HogwildDDP(Hogwild, DDPStrategy):
    def configure_ddp(self) -> None:
        # No DistributedDataParallel wrapper: the gradients stay local. Parameters come from
        # rank 0 through the shared memory; buffers, each worker's own, start as rank 0's.
        for buffer in self.model.buffers():
            dist.broadcast(buffer, src=0)


class HogwildSingleDevice(Hogwild, SingleDeviceStrategy):
    pass
