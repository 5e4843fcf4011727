"""Data helpers: loaders whose sample order is the same for any number of processes."""

from __future__ import annotations

import os

import torch
from torch.utils.data import DataLoader, Dataset

from framework.data.sampler import GlobalOrderSampler

__all__ = ["GlobalOrderSampler", "make_loader"]


def make_loader(
    dataset: Dataset,
    batch_size: int,
    shuffle: bool,
    seed: int | None = None,
    drop_last: bool | None = None,
    num_workers: int = 0,
) -> DataLoader:
    """A DataLoader over this rank's share of one global order.

    `batch_size` is per process. `seed` defaults to the run's seed (set by the runner through
    Lightning's seed_everything); training loaders drop the ragged tail, evaluation loaders pad it
    with at most world_size - 1 repeated samples so every rank runs the same number of batches.
    On CUDA batches go through pinned memory (a faster, asynchronous copy to the device); with
    workers, each keeps 4 batches ready (torch's default is 2), which absorbs uneven load times.
    """
    if seed is None:
        seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
    drop = shuffle if drop_last is None else drop_last
    sampler = GlobalOrderSampler(len(dataset), shuffle=shuffle, seed=seed, drop_last=drop)
    # Worker seeds come from this generator, so starting an epoch never draws from the global RNG
    # that dropout uses: training randomness does not depend on when loaders are (re)created.
    generator = torch.Generator().manual_seed(seed)
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        drop_last=drop,
        num_workers=num_workers,
        persistent_workers=num_workers > 0,
        pin_memory=torch.cuda.is_available(),
        prefetch_factor=4 if num_workers > 0 else None,
        generator=generator,
    )
