"""Test helpers for float8 training and the Muon optimizer."""

from __future__ import annotations

import json
import os

import lightning.pytorch as pl


class StepMeanLoss(pl.Callback):
    """Writes `out`/mean-losses.json on rank 0 at the end of training: per optimizer step, the
    mean of its micro-batches' losses (what a data-parallel or pipeline run logs as
    train/loss, where one process with gradient accumulation logs only the last)."""

    def __init__(self, out: str) -> None:
        self.out = out
        self.steps: dict[int, float] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # Lightning hands on each micro-batch's loss divided by accumulate_grad_batches
        step = trainer.global_step - (not trainer.fit_loop.epoch_loop._should_accumulate())
        loss = float(outputs["loss"]) if isinstance(outputs, dict) else float(outputs)
        self.steps[step] = self.steps.get(step, 0.0) + loss

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.global_rank == 0:
            with open(os.path.join(self.out, "mean-losses.json"), "w") as fh:
                json.dump(self.steps, fh)
