"""Tasks used by the tests: a digits task that fails on purpose, and a plain LightningModule."""

from __future__ import annotations

import time

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn

from recipes.digits.task import DigitsTask


class FailingDigitsTask(DigitsTask):
    """Raises on `fail_rank` at `fail_step`; the other ranks carry on into the next collective."""

    def __init__(self, fail_rank: int = 1, fail_step: int = 3, hidden: int = 32) -> None:
        super().__init__(hidden=hidden)
        self.fail_rank = fail_rank
        self.fail_step = fail_step

    def training_step(self, batch, batch_idx):
        if self.global_step == self.fail_step and self.global_rank == self.fail_rank:
            raise RuntimeError(f"deliberate failure at step {self.fail_step}")
        if self.global_step > self.fail_step:
            time.sleep(0.05)
        return super().training_step(batch, batch_idx)


class PlainDigits(pl.LightningModule):
    """A LightningModule that knows nothing of the framework: its own configure_optimizers."""

    def __init__(self, hidden: int = 32, lr: float = 0.01) -> None:
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train/loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)
