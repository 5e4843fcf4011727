"""The per-step vote on a preemption signal, for the checkpoint callback (framework/callbacks/
_checkpointer.py): every rank stops at the same step, whichever rank the signal reached."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class PreemptionVote:
    """Whether any rank got SIGTERM/SIGUSR1/SIGUSR2, decided by all ranks at the same step.

    A blocking all-reduce every step would cost a round trip per step (about 30% of a small
    DDP step on CPU). Instead each step starts an asynchronous all-reduce of this rank's flag and
    reads the previous step's result, which has long arrived: the job stops one step later, at
    no waiting cost. The flag is a CPU tensor on a gloo group: reading a CUDA flag (`.item()`)
    would wait for everything queued on the GPU, the whole step, every step.
    """

    def __init__(self) -> None:
        self.pending: tuple[Any, torch.Tensor] | None = None
        self.group: Any = None
        self.alone: bool | None = None  # one process: nothing to vote on

    def agreed(self, local: int) -> int:
        """The highest signal number any rank got (0: none), as of the previous step."""
        if self.alone is None:  # the world does not change during a run: asked once
            initialized = dist.is_available() and dist.is_initialized()
            self.alone = not initialized or dist.get_world_size() == 1
        if self.alone:
            return local
        decided = 0
        if self.pending is not None:
            work, flag = self.pending
            work.wait()
            decided = int(flag.item())
        if self.group is None:  # every rank votes at the same step: a collective creation
            gloo = dist.get_backend() == "gloo"
            self.group = dist.group.WORLD if gloo else dist.new_group(backend="gloo")
        flag = torch.tensor([int(local)])
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        self.pending = (work, flag)
        return decided

    def finish(self) -> None:
        if self.pending is not None:
            self.pending[0].wait()
            self.pending = None
