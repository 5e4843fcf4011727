"""Tasks and data for the loss guard's tests (tests/distributed/test_loss_guard.py): a digits task
whose loss goes bad at chosen steps, and digits in a fixed order that can leave samples out."""

from __future__ import annotations

import lightning.pytorch as pl
import torch

from recipes.digits.task import DigitsTask


class BadStepDigits(DigitsTask):
    """DigitsTask whose training loss is NaN at the global steps `nan_steps` and 50 times too
    large at `spike_steps`; on rank `bad_rank` only (None: every rank). The loss is changed in
    `loss`, which the last pipeline stage calls too."""

    def __init__(
        self,
        hidden: int = 16,
        dropout: float = 0.0,
        nan_steps: tuple[int, ...] = (),
        spike_steps: tuple[int, ...] = (),
        bad_rank: int | None = None,
    ) -> None:
        super().__init__(hidden=hidden, dropout=dropout)
        self.nan_steps = set(nan_steps)
        self.spike_steps = set(spike_steps)
        self.bad_rank = bad_rank

    def loss(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = super().loss(logits, y)
        if not self.training or self.bad_rank not in (None, self.global_rank):
            return loss
        if self.global_step in self.nan_steps:
            return loss * float("nan")
        if self.global_step in self.spike_steps:
            return loss * 50.0
        return loss


class OrderedDigits(pl.LightningDataModule):
    """The digits training set in a fixed order (no shuffling), without the samples whose
    indices are in `leave_out`: a run without those samples is the reference of a guarded run
    that skipped them."""

    def __init__(self, batch_size: int = 32, leave_out: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.leave_out = set(leave_out)

    def setup(self, stage=None) -> None:
        from recipes.digits.data import DigitsDataModule

        inner = DigitsDataModule(batch_size=self.batch_size)
        inner.setup()
        keep = [i for i in range(len(inner.train_set)) if i not in self.leave_out]
        self.train_set = torch.utils.data.Subset(inner.train_set, keep)

    def train_dataloader(self):
        from framework.data import make_loader

        return make_loader(self.train_set, self.batch_size, shuffle=False)
