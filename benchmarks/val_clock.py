"""A callback `benchmarks/async.py` adds to `fw train` from the command line: the validation loss
against training wall time. Changes nothing in training.

On rank 0, at the end of every validation (not the sanity check) it records the optimizer step,
the seconds of training so far and the validation loss. Training time runs from the start of the
first training batch and leaves out the time spent in validation, so that sides validating at
different intervals are on the same clock. With `budget_s`, training stops at the first
validation after that many seconds of training (rank 0's clock decides, for every rank).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import lightning.pytorch as pl


class ValClock(pl.Callback):
    """Writes [{"step", "train_s", "val_loss"}, ...] as JSON to `path`."""

    def __init__(self, path: str, budget_s: float | None = None, metric: str = "val/loss") -> None:
        self.path = Path(path)
        self.budget_s = budget_s
        self.metric = metric
        self.start: float | None = None
        self.validating_since = 0.0
        self.validation_s = 0.0
        self.points: list[dict[str, float]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.start is None:
            self.start = time.perf_counter()

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.validating_since = time.perf_counter()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        now = time.perf_counter()
        if trainer.sanity_checking or self.start is None:
            return
        train_s = self.validating_since - self.start - self.validation_s
        self.validation_s += now - self.validating_since
        loss = float(trainer.callback_metrics[self.metric])
        self.points.append({"step": trainer.global_step, "train_s": train_s, "val_loss": loss})
        if self.budget_s is not None:
            stop = trainer.strategy.broadcast(train_s >= self.budget_s, src=0)
            trainer.should_stop = trainer.should_stop or stop

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_rank == 0:
            self.path.write_text(json.dumps(self.points))
