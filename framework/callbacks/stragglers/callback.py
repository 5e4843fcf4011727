"""The Lightning callback behind `callbacks.stragglers` (imports Lightning: loaded in workers)."""

from __future__ import annotations

import logging
import statistics
import time

import lightning.pytorch as pl
import torch.distributed as dist

from framework.runtime.hooks import skip_unused

log = logging.getLogger("framework.stragglers")


class Stragglers(pl.Callback):
    """Each rank's time per batch (data wait + own compute), compared across the ranks every
    `every_n_steps` batches. Idle in one process (nothing to compare): no clock is read. On the
    CPU a batch costs two wall-clock and two thread-CPU-clock reads, on CUDA three wall-clock
    reads: the figure is per batch, so it is read per batch."""

    def __init__(self, cfg) -> None:
        self.cfg = cfg
        self.active = False  # several processes: decided at train start
        self.cuda = False
        self.seconds = 0.0  # this rank's own seconds, summed over this window's batches
        self.batches = 0  # in this window
        self.totals: list[float] = []  # every rank's mean seconds per batch, summed
        self.windows = 0
        self.flagged: dict[int, int] = {}
        self.batch_start = self.forward_end = self.last_end = None
        self.cpu_start = 0.0
        skip_unused(self)

    def on_train_start(self, trainer, pl_module) -> None:
        self.active = trainer.world_size > 1 and dist.is_available() and dist.is_initialized()
        self.cuda = trainer.strategy.root_device.type == "cuda"
        if not self.active:
            skip_unused(self, idle=True)  # Lightning passes it by at every step
        elif not self.cuda:
            self.on_before_backward = None  # the forward's end is read on CUDA only

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if not self.active:
            return
        self.batch_start = time.perf_counter()
        if self.cuda:
            self.forward_end = None
        else:
            self.cpu_start = time.thread_time()

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        if self.cuda and self.active and self.forward_end is None:
            self.forward_end = time.perf_counter()

    def on_validation_start(self, trainer, pl_module) -> None:
        self.last_end = None  # validation time is not data wait

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not self.active or self.batch_start is None:
            return
        now = time.perf_counter()
        waited = self.batch_start - self.last_end if self.last_end is not None else 0.0
        if self.cuda:
            own = (self.forward_end or now) - self.batch_start
        else:
            own = time.thread_time() - self.cpu_start
        self.seconds += waited + own
        self.batches += 1
        self.last_end = now
        if self.batches >= self.cfg.every_n_steps:
            self.compare(trainer, pl_module)

    def compare(self, trainer, pl_module) -> None:
        mine = self.seconds / self.batches
        self.seconds, self.batches = 0.0, 0
        every: list = [None] * trainer.world_size
        dist.all_gather_object(every, mine)  # every rank calls it, at the same batch
        median = statistics.median(every)
        slowest = max(range(len(every)), key=every.__getitem__)
        ratio = every[slowest] / median if median > 0 else 1.0
        pl_module.log("perf/slowest_rank", float(slowest), rank_zero_only=True)
        pl_module.log("perf/straggler_ratio", ratio, rank_zero_only=True)
        self.totals = (
            [a + b for a, b in zip(self.totals, every, strict=True)] if self.totals else every
        )
        self.windows += 1
        # the first window holds the start (compilation, caches, loader workers): not judged
        if ratio > self.cfg.threshold and self.windows > 1:
            self.flagged[slowest] = self.flagged.get(slowest, 0) + 1
            if (
                trainer.is_global_zero
                and len(self.flagged) == 1
                and sum(self.flagged.values()) == 1
            ):
                log.warning(
                    "Straggler at step %d: rank %d takes %.3f s per batch (data wait + own compute), "
                    "%.1fx the median %.3f s",
                    trainer.global_step,
                    slowest,
                    every[slowest],
                    ratio,
                    median,
                )

    def on_train_end(self, trainer, pl_module) -> None:
        if not trainer.is_global_zero or not self.windows or not self.flagged:
            return
        means = [t / self.windows for t in self.totals]
        median = statistics.median(means)
        rows = [
            f"  rank {r:>4}  {m:8.4f} s  {m / median if median else 1.0:5.2f}x  "
            f"{self.flagged.get(r, 0):>3} of {self.windows}"
            for r, m in enumerate(means)
        ]
        log.warning(
            "Stragglers (data wait + own compute per batch, x median, windows above %.2gx):\n%s",
            self.cfg.threshold,
            "\n".join(rows),
        )
