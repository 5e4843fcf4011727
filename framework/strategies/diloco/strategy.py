"""The Lightning strategies behind `strategy=diloco|localsgd` (imports Lightning: workers only).

Gradients are never all-reduced: the task is not wrapped in DistributedDataParallel (its
parameters are broadcast from rank 0 once, as DDP's constructor would), so each process's inner
optimizer steps on its own gradients. After each inner step `Rounds.after_inner_step` runs the
outer step of the fragments whose round ends there.

A checkpoint is ddp's Lightning file (written by rank 0 from what it holds itself; nothing is
gathered) with these differences:
- `state_dict` holds the outer (start-of-round) parameters: the model the processes agreed on last;
- `optimizer_states` holds the processes' inner optimizer states averaged (what ddp, or any other
  strategy, resumes with; for a momentum buffer it is exactly ddp's), all-reduced tensor by
  tensor;
- the key `diloco` holds the outer state (`Rounds.state_dict`) and `replicas`, the process count;
- each process writes its own inner optimizer state and, mid-round only, its own model into its
  own file of the checkpoint (`replicas/rankNNNNN.pt`, framework.parallel.replicas): no process
  gathers another's.
Resuming with as many processes puts each replica back, so a resume at any step continues
exactly (the checkpointer restores each process's RNG and the data position). With another
process count, or from a checkpoint without `diloco` (ddp, or any layout moved in), the rounds
start again from the saved model at the resumed step.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from lightning.pytorch.trainer.states import TrainerFn

from framework.parallel.replicas import mean_states, read_replica, write_replica
from framework.strategies.diloco.rounds import Rounds
from framework.strategy_base import Replicated

log = logging.getLogger("framework.diloco")
KEY = "diloco"  # the checkpoint's key for the outer state


class DiLoCo(Replicated):
    """Inner steps on local gradients, an outer step on the averaged pseudo-gradient every H."""

    def __init__(self, cfg: Any, *args: Any, **kwargs: Any) -> None:
        self.cfg = cfg
        self.rounds: Rounds | None = None
        super().__init__(*args, **kwargs)

    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            self.rounds = Rounds(self.cfg, self.lightning_module)

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        out = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self.rounds is None:
            return out
        metrics = self.rounds.after_inner_step()
        module = self.lightning_module
        for name in ("comm/bytes_per_step", "comm/ddp_bytes_per_step"):
            module.log(name, metrics.pop(name), on_step=True, on_epoch=False)
        if metrics and self.is_global_zero:  # at a synchronisation only: not repeated after
            for logger in module.trainer.loggers:
                logger.log_metrics(metrics, step=module.trainer.global_step)
        return out

    # ---- checkpoints
    def lightning_module_state_dict(self) -> dict[str, Any]:
        state = super().lightning_module_state_dict()
        return state if self.rounds is None else self.rounds.with_outer(state)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options=None):
        if self.rounds is not None:
            saved = self.rounds.state_dict()
            # the inner optimizer states always differ between processes; the models only
            # until the end of a round
            own = {"optimizers": [opt.state_dict() for opt in self.optimizers]}
            if not self.rounds.synced():
                own["model"] = self.lightning_module.state_dict()
            write_replica(Path(filepath).parent, self.global_rank, own)
            # what another strategy reads: the processes' mean
            checkpoint["optimizer_states"] = mean_states(self.optimizers)
            saved["replicas"] = self.world_size
            checkpoint[KEY] = saved
        super().save_checkpoint(checkpoint, filepath, storage_options)
        self.barrier("replicas-written")  # every file is written before rank 0 commits

    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        super().load_optimizer_state_dict(checkpoint)
        if self.rounds is None:
            return
        self.rounds.restart()  # from the saved model: the outer parameters
        saved = checkpoint.get(KEY)
        if saved is None:
            log.info("No DiLoCo state in the checkpoint: the first round starts here.")
            return
        replicas = saved["replicas"]
        count = replicas if isinstance(replicas, int) else len(replicas)
        if count != self.world_size:
            log.warning(
                "The checkpoint was written by %d processes, not %d: each starts from the mean "
                "inner optimizer state, from the outer parameters (the steps since the last "
                "synchronisation are dropped), and the rounds start again.",
                count,
                self.world_size,
            )
            return
        self.rounds.load_state_dict(saved, self.rounds.outer_by_name())
        own = (
            replicas[self.global_rank]
            if isinstance(replicas, list)  # written by an earlier version, gathered
            else read_replica(self.checkpoint_dir, self.global_rank, self.inputs.trust_checkpoint)
        )
        if "model" in own:
            self.lightning_module.load_state_dict(own["model"])
        for optimizer, state in zip(self.optimizers, own["optimizers"], strict=True):
            optimizer.load_state_dict(state)


class DiLoCoDDP(DiLoCo, DDPStrategy):
    def configure_ddp(self) -> None:
        # No DistributedDataParallel wrapper: the gradients stay local. The same start
        # everywhere, as DDP's constructor would make it.
        for tensor in self.model.state_dict().values():
            dist.broadcast(tensor, src=0)


class DiLoCoSingleDevice(DiLoCo, SingleDeviceStrategy):
    pass
