"""The digits task written the usual Lightning way, with no framework: the benchmarks' baseline.

`python -m benchmarks.plain_lightning --devices N --max-steps S [--hidden H] [--batch-size B]
[--first-step PATH] [--step-times PATH] [--bare]` trains the same MLP, on the same data split,
with the same AdamW settings as `fw train task=digits` (hidden width and batch size default to
conf/task/digits.yaml's). With two devices it uses Lightning's own `ddp` strategy, which
starts the second process by re-running this command. Used by benchmarks.startup (against `fw
train`) and by benchmarks.overhead (to tell Lightning's per-step cost from the framework's).
"""

from __future__ import annotations

import argparse
import tempfile

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger
from omegaconf import OmegaConf
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.common import ROOT
from benchmarks.step_timer import FirstStep, StepTimer


class Digits(pl.LightningModule):
    def __init__(self, hidden: int, dropout: float, lr: float, weight_decay: float) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Linear(64, hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, 10)
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(
            self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay
        )


def train_loader(batch_size: int, val_fraction: float) -> DataLoader:
    """The training part of the same split as recipes.digits.data.DigitsDataModule."""
    from sklearn.datasets import load_digits

    images, labels = load_digits(return_X_y=True)
    x = torch.tensor(images, dtype=torch.float32) / 16.0
    y = torch.tensor(labels, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    train = order[int(len(x) * val_fraction) :]
    return DataLoader(
        TensorDataset(x[train], y[train]), batch_size=batch_size, shuffle=True, drop_last=True
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--max-steps", type=int, default=2)
    parser.add_argument("--hidden", type=int, help="default: conf/task/digits.yaml's")
    parser.add_argument("--batch-size", type=int, help="default: conf/task/digits.yaml's")
    parser.add_argument("--first-step", help="file for FirstStep (needs $BENCH_T0)")
    parser.add_argument("--step-times", help="file for StepTimer")
    parser.add_argument("--root", default=tempfile.gettempdir(), help="Lightning's root dir")
    parser.add_argument("--bare", action="store_true", help="no logger, no checkpoints")
    args = parser.parse_args()
    task = OmegaConf.load(ROOT / "conf" / "task" / "digits.yaml")
    pl.seed_everything(0, workers=True, verbose=False)
    hidden = args.hidden or task.model.hidden
    batch_size = args.batch_size or task.data.batch_size
    model = Digits(hidden, task.model.dropout, task.optimizer.lr, task.optimizer.weight_decay)
    callbacks = []
    if args.first_step:
        callbacks.append(FirstStep(args.first_step))
    if args.step_times:
        callbacks.append(StepTimer(args.step_times))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy="ddp" if args.devices > 1 else "auto",
        max_steps=args.max_steps,
        callbacks=callbacks,
        enable_progress_bar=False,
        default_root_dir=args.root,
        logger=False if args.bare else CSVLogger(args.root),  # as fw's logger=[csv]
        enable_checkpointing=not args.bare,
    )
    trainer.fit(model, train_loader(batch_size, task.data.val_fraction))


if __name__ == "__main__":
    main()
