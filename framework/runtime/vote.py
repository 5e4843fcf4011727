"""The per-step vote on a preemption signal, for the checkpoint callback
(framework/callbacks/checkpoint/callback.py): every rank stops at the same step, whichever rank the signal reached.

It also takes the place of Lightning's own SIGTERM check (`vote_on_sigterm`, for fw's Trainer):
at the start of every step Lightning broadcasts from rank 0 whether it got SIGTERM and reads the
answer (`.item()`), a blocking collective and, on a GPU, a wait for the previous step's work,
every step. In its place each step starts the vote's asynchronous all-reduce and reads the
previous step's, so every rank raises Lightning's SIGTERMException at the same step, one step
later, without waiting; with the checkpoint callback voting (on its own signals and Lightning's
flag) there is nothing else to do. Lightning's SIGTERM handler broadcasts too, from inside the
handler (a collective the other ranks no longer enter): it is replaced by one that records the
signal. On 2 CPU processes of the benchmarks' small GPT, the step without the broadcast and
without the barrier before each logged all-reduce (framework/strategy_base.py) takes 0.945 of
the time under ddp and 0.975 under diloco (docs/benchmarks.md)."""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from framework.world import host_group

log = logging.getLogger("framework")


class PreemptionVote:
    """Whether any rank got SIGTERM/SIGUSR1/SIGUSR2, decided by all ranks at the same step.

    A blocking all-reduce every step would cost a round trip per step (about 30% of a small
    DDP step on CPU). Instead each step starts an asynchronous all-reduce of this rank's flag and
    reads the previous step's result, which has long arrived: the job stops one step later, at
    no waiting cost. The flag is a CPU tensor on a gloo group of its own
    (framework.world.host_group): reading a CUDA flag (`.item()`) would wait for everything
    queued on the GPU, the whole step, every step.
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
            self.group = host_group("preemption-vote")
        flag = torch.tensor([int(local)])
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        self.pending = (work, flag)
        return decided

    def finish(self) -> None:
        if self.pending is not None:
            self.pending[0].wait()
            self.pending = None


def vote_on_sigterm(trainer: Any, voted: bool = False):
    """Replace Lightning's per-step SIGTERM broadcast (and its handler's) with an asynchronous
    vote; returns the vote (`finish()` it after `fit`), None for a Lightning without the
    broadcast, or when `voted`: the checkpoint callback votes on SIGTERM (Lightning's flag
    included) and saves before stopping."""
    loop = trainer.fit_loop.epoch_loop
    connector = trainer._signal_connector
    if not hasattr(loop, "_broadcast_sigterm_tensor"):
        return None
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    def notified(signum: int, frame: Any) -> None:
        log.info("Rank %d received SIGTERM (%d)", trainer.global_rank, signum)
        launcher = trainer.strategy.launcher  # processes Lightning started itself, as Lightning
        if not connector.received_sigterm and launcher is not None:
            launcher.kill(signum)
        connector.received_sigterm = True

    if hasattr(connector, "_sigterm_notifier_fn"):
        connector._sigterm_notifier_fn = notified
    if voted:
        loop._broadcast_sigterm_tensor = lambda: None
        return None
    vote = PreemptionVote()

    def broadcast_sigterm() -> None:  # Lightning calls it with several processes only
        if vote.agreed(int(connector.received_sigterm)):
            raise SIGTERMException()

    loop._broadcast_sigterm_tensor = broadcast_sigterm
    return vote
