"""The console's progress bar (`trainer.enable_progress_bar`, rank 0): one bar for the whole
run, counted in optimizer steps.

Lightning's bars count the batches of one epoch and start again at each epoch: a run bounded by
steps shows `Epoch 0/-2` (max_epochs=-1), a resume `20/9`, gradient accumulation `20/10`. This
one counts the optimizer steps of the run from where it (re)started to its end (max_steps, or
the steps of max_epochs epochs), and names the epoch only when the epochs are bounded.
Validation, test and prediction keep Lightning's own bars.
"""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import TQDMProgressBar


def total_steps(trainer: pl.Trainer) -> int | None:
    """The optimizer steps the run ends at (None: unbounded, or not known in advance)."""
    if trainer.max_steps > 0:
        return int(trainer.max_steps)
    try:
        estimated = trainer.estimated_stepping_batches
    except Exception:  # a loader without a length
        return None
    return int(estimated) if math.isfinite(estimated) else None


def epochs_bounded(trainer: pl.Trainer) -> bool:
    return trainer.max_epochs is not None and trainer.max_epochs > 0


class StepProgressBar(TQDMProgressBar):
    """Lightning's tqdm bar over the run's optimizer steps (see the module docstring)."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.train_progress_bar = self.init_train_tqdm()
        bar = self.train_progress_bar
        bar.reset(total=total_steps(trainer))
        bar.initial = bar.n = trainer.global_step
        bar.set_description(self.describe(trainer))
        bar.refresh()

    def describe(self, trainer: pl.Trainer) -> str:
        if epochs_bounded(trainer):
            return f"Epoch {trainer.current_epoch + 1}/{trainer.max_epochs}"
        return "Steps"

    def on_train_epoch_start(self, trainer: pl.Trainer, *_: Any) -> None:
        if self.train_progress_bar is not None:
            self.train_progress_bar.set_description(self.describe(trainer))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        bar, step = self.train_progress_bar, trainer.global_step
        if bar is None or step == bar.n:  # accumulating: no optimizer step yet
            return
        if self._should_update(step, bar.total or 0):
            bar.n = step
            bar.set_postfix(self.get_metrics(trainer, pl_module))
            bar.refresh()

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.train_progress_bar is not None and not self.train_progress_bar.disable:
            metrics = self.get_metrics(trainer, pl_module)
            self.train_progress_bar.set_postfix(metrics, refresh=False)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        bar = self.train_progress_bar
        if bar is not None:
            bar.n = trainer.global_step
            bar.close()  # drawn once more, as it ends

    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict:
        """The task's progress-bar metrics, without the logger's version (`v_num`)."""
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)
        return metrics
