"""A compute-bound task for the pipeline benchmark: random rows through a deep stack of equal wide
layers, so each pipeline stage costs the same and compute dominates the messages."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import TensorDataset

from framework.data import make_loader
from recipes.digits.task import DigitsTask


class WideStack(DigitsTask):
    """The digits task's loss and steps; its net `depth` layers Linear(width, width) + ReLU
    between a small input and output layer."""

    def __init__(self, width: int = 2048, depth: int = 8) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(64, width),
            *(nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(depth)),
            nn.Linear(width, 10),
        )


class RandomRows(pl.LightningDataModule):
    """`n` fixed random rows of 64 features with labels 0-9 (seeded): enough rows for big batches."""

    def __init__(self, batch_size: int = 64, n: int = 8192) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.n = n

    def setup(self, stage: str | None = None) -> None:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(self.n, 64, generator=g)
        self.rows = TensorDataset(x, torch.randint(0, 10, (self.n,), generator=g))

    def train_dataloader(self):
        return make_loader(self.rows, self.batch_size, shuffle=True)
