"""`callbacks.stragglers`: name the rank that makes the others wait.

Every rank times its own part of each training batch: the wall time it waited for its data, plus
the CPU time its training thread spent in the step. A rank blocked in a collective (gloo waits
without spinning) spends no CPU time, so the ranks that wait for a straggler do not look slow.
Every `every_n_steps` batches the ranks compare their mean times; the slowest rank and its ratio
to the median are logged (`perf/slowest_rank`, `perf/straggler_ratio`), a rank above
`threshold` x the median is named in the console, and a table of every rank ends the run.

On CUDA the step's compute runs on the GPU, so the host's wall clock from the batch start to the
backward is used instead. It is host time, not GPU time: kernels are queued asynchronously, so it
measures how long the host took to queue the forward plus any wait for the GPU (a full launch
queue, a value read back such as a logged metric), and follows a slow GPU only where the host
waits for it. Collectives inside the forward (FSDP and tensor-parallel all-gathers, metrics
logged with sync_dist) make the waiting ranks look slow too. On CUDA the ratio is a rough sign,
not a measurement. One process: nothing to compare.
"""

from __future__ import annotations

from dataclasses import dataclass

from framework.config.fields import doc


@dataclass
class Config:
    """Per-rank step time compared across ranks; the slowest rank named."""

    kind: str = doc("stragglers", "Callback plugin.")
    every_n_steps: int = doc(20, "Compare the ranks every this many training batches.", min=1)
    threshold: float = doc(
        1.5, "Name a rank whose time per batch exceeds this multiple of the median.", above=1.0
    )


def validate(cfg: Config, world) -> None:
    """The bounds are declared on the fields; nothing else to check before launch."""


def build(cfg: Config, ctx):
    import logging
    import statistics
    import time

    import lightning.pytorch as pl
    import torch.distributed as dist

    log = logging.getLogger("framework.stragglers")

    class Stragglers(pl.Callback):
        def __init__(self) -> None:
            self.window: list[float] = []  # this rank's own seconds per batch, this window
            self.totals: list[float] = []  # every rank's mean seconds per batch, summed
            self.windows = 0
            self.flagged: dict[int, int] = {}
            self.batch_start = self.forward_end = self.last_end = None
            self.cpu_start = 0.0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self.batch_start = time.perf_counter()
            self.cpu_start = time.thread_time()
            self.forward_end = None

        def on_before_backward(self, trainer, pl_module, loss) -> None:
            self.forward_end = self.forward_end or time.perf_counter()

        def on_validation_start(self, trainer, pl_module) -> None:
            self.last_end = None  # validation time is not data wait

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            now = time.perf_counter()
            if self.batch_start is None or trainer.world_size == 1 or not dist.is_initialized():
                return
            waited = self.batch_start - self.last_end if self.last_end is not None else 0.0
            if trainer.strategy.root_device.type == "cuda":
                own = (self.forward_end or now) - self.batch_start
            else:
                own = time.thread_time() - self.cpu_start
            self.window.append(waited + own)
            self.last_end = now
            if len(self.window) >= cfg.every_n_steps:
                self.compare(trainer, pl_module)

        def compare(self, trainer, pl_module) -> None:
            mine = sum(self.window) / len(self.window)
            self.window = []
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
            if ratio > cfg.threshold:
                self.flagged[slowest] = self.flagged.get(slowest, 0) + 1
                if trainer.is_global_zero:
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
                cfg.threshold,
                "\n".join(rows),
            )

    return Stragglers()
