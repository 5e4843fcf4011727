"""scikit-learn's bundled 8x8 handwritten digits (1797 images, no download), split train/val."""

from __future__ import annotations

import gzip
import importlib.util
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import TensorDataset

from framework.data import make_loader
from framework.errors import ConfigError


def digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """The images (1797 x 64, values 0-16) and labels, as `load_digits(return_X_y=True)` gives
    them: read from scikit-learn's bundled file without importing scikit-learn, which takes
    about 0.7 s in each process that loads the data (load_digits itself where the file moved)."""
    spec = importlib.util.find_spec("sklearn")  # finds the package, runs none of it
    path = spec and Path(spec.submodule_search_locations[0], "datasets", "data", "digits.csv.gz")
    if not path or not path.is_file():
        from sklearn.datasets import load_digits

        return load_digits(return_X_y=True)
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        data = np.loadtxt(fh, delimiter=",")
    return data[:, :-1], data[:, -1].astype(int)


class DigitsDataModule(pl.LightningDataModule):
    """Digits as 64 features in [0, 1] and a label 0-9; the split is fixed by `split_seed`."""

    def __init__(
        self,
        batch_size: int = 64,
        val_fraction: float = 0.2,
        split_seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.split_seed = split_seed
        self.num_workers = num_workers

    @staticmethod
    def validate_config(prefix: str, args: dict) -> None:
        if args.get("batch_size", 64) < 1:
            raise ConfigError(f"{prefix}.batch_size", args["batch_size"], "must be at least 1")
        if not 0.0 < args.get("val_fraction", 0.2) < 1.0:
            raise ConfigError(
                f"{prefix}.val_fraction", args["val_fraction"], "must be between 0 and 1"
            )

    def setup(self, stage: str | None = None) -> None:
        images, labels = digits_arrays()
        x = torch.tensor(images, dtype=torch.float32) / 16.0
        y = torch.tensor(labels, dtype=torch.long)
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(self.split_seed))
        n_val = int(len(x) * self.val_fraction)
        val, train = order[:n_val], order[n_val:]
        self.train_set = TensorDataset(x[train], y[train])
        self.val_set = TensorDataset(x[val], y[val])

    def train_dataloader(self):
        return make_loader(
            self.train_set, self.batch_size, shuffle=True, num_workers=self.num_workers
        )

    def val_dataloader(self):
        return make_loader(
            self.val_set, self.batch_size, shuffle=False, num_workers=self.num_workers
        )

    def test_dataloader(self):
        """The held-out split (the validation split: 1797 images leave no room for a third)."""
        return self.val_dataloader()

    def predict_dataloader(self):
        return self.val_dataloader()
