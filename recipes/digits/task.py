"""Classify handwritten digits with a small MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from framework import TaskModule


class DigitsTask(TaskModule):
    """A two-layer perceptron on 8x8 digit images; logs train/loss, val/loss and val/acc (and
    test/loss, test/acc under `fw test`; `fw predict` gives each image's logits)."""

    def __init__(self, hidden: int = 128, dropout: float = 0.0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Linear(64, hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, 10)
        )
        self.val_acc = MulticlassAccuracy(num_classes=10, average="micro")
        self.val_loss = MeanMetric()
        self.test_acc = MulticlassAccuracy(num_classes=10, average="micro")
        self.test_loss = MeanMetric()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def loss(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits, y)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = self.loss(self(x), y)
        self.log("train/loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.val_loss.update(F.cross_entropy(logits, y, reduction="none"))
        self.val_acc.update(logits, y)
        self.log("val/loss", self.val_loss, prog_bar=True)
        self.log("val/acc", self.val_acc, prog_bar=True)

    def test_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.test_loss.update(F.cross_entropy(logits, y, reduction="none"))
        self.test_acc.update(logits, y)
        self.log("test/loss", self.test_loss)
        self.log("test/acc", self.test_acc)

    def predict_step(self, batch, batch_idx):
        """The logits of each image (`fw predict`)."""
        x, _ = batch
        return self(x)
