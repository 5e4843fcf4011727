"""`callbacks.throughput`: training speed as metrics (perf/steps_per_sec, perf/samples_per_sec)."""

from __future__ import annotations

from dataclasses import dataclass

from framework.config.fields import doc


@dataclass
class Config:
    """Log steps and samples per second, averaged over a window of steps."""

    kind: str = doc("throughput", "Callback plugin.")
    window: int = doc(10, "Average over this many optimizer steps.", min=1)


def validate(cfg: Config, world) -> None:
    """The window's bound is declared on the field; nothing else to check before launch."""


def build(cfg: Config, ctx):
    import time

    import lightning.pytorch as pl

    data_ranks = ctx.data_parallel[1]

    class Throughput(pl.Callback):
        """Wall-clock speed of training steps, on rank 0 (validation time excluded)."""

        def __init__(self) -> None:
            self.start: float | None = None
            self.steps = 0
            self.samples = 0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if self.start is None:
                self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.steps += 1
            per_rank = getattr(trainer.train_dataloader, "batch_size", None) or 0
            self.samples += per_rank * data_ranks  # tensor/pipeline ranks share their batch
            if self.steps >= cfg.window and self.start is not None:
                seconds = time.perf_counter() - self.start
                pl_module.log("perf/steps_per_sec", self.steps / seconds, rank_zero_only=True)
                if self.samples:
                    pl_module.log(
                        "perf/samples_per_sec", self.samples / seconds, rank_zero_only=True
                    )
                self.start, self.steps, self.samples = None, 0, 0

        def on_validation_start(self, trainer, pl_module) -> None:
            self.start, self.steps, self.samples = None, 0, 0

    return Throughput()
