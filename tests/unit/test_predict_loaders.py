"""`fw predict` on a task whose loader takes its batch size positionally (`DataLoader(data, 8)`):
Lightning rebuilds the loader to record each sample's index and stopped the run with a
MisconfigurationException (`batch_size` passed twice); the worker hands Lightning keywords."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from framework.runtime.evaluation import run

DATA = TensorDataset(torch.arange(20.0).reshape(10, 2))


class Positional(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
        self.sizes: list[int] = []

    def predict_step(self, batch, batch_idx):
        self.sizes.append(len(batch[0]))
        return self.layer(batch[0])

    def predict_dataloader(self):
        return DataLoader(DATA, 4, False)  # batch_size and shuffle by position


class PositionalData(pl.LightningDataModule):
    def predict_dataloader(self):
        return [DataLoader(DATA, 3)]


def trainer() -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False,
    )  # fmt: skip


@pytest.mark.parametrize(("data", "sizes"), [(None, [4, 4, 2]), (PositionalData(), [3, 3, 3, 1])])
def test_a_loader_given_its_batch_size_by_position_predicts_in_its_batches(data, sizes):
    task = Positional()
    run(trainer(), task, data, "predict", None)
    assert task.sizes == sizes, "every sample once, in the loader's own batch size"
    source = data if data is not None else task
    assert "predict_dataloader" not in vars(source), "the task's own hook is back"
