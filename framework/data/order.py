"""One global sample order for any DataLoader, whatever the number of processes.

Lightning distributes a plain DataLoader by injecting a DistributedSampler, whose order depends on
the number of processes and whose position is not saved: a mid-epoch resume replays or skips
data. With `task.data_order=global` (the default) the framework's strategies instead give every
loader built on a plain `RandomSampler` (shuffle=True) or `SequentialSampler` a
`GlobalOrderSampler` (framework.data.sampler): the same shuffle, drop_last, batch size, workers
and collate function; one seeded order per epoch, split over the data-parallel ranks; its position
saved in every checkpoint. A custom sampler is split over the ranks in its own order (Lightning's
DistributedSamplerWrapper, without extra shuffling) and an iterable dataset is left alone: for
those a mid-epoch resume is exact only if the sampler or dataset has `state_dict()` /
`load_state_dict()` (saved with the checkpoint), and a warning says so at start.
`task.data_order=keep` leaves every loader to Lightning.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from torch.utils.data import (
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)

from framework.data.sampler import GlobalOrderSampler, bind

log = logging.getLogger("framework.data")


def stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


def resumable_part(loader: Any) -> Any:
    """The sampler or dataset of a loader that saves its own position (`state_dict`), or None."""
    for part in (
        getattr(loader, "sampler", None),
        getattr(getattr(loader, "batch_sampler", None), "sampler", None),
        getattr(loader, "dataset", None),
    ):
        if part is not None and not isinstance(part, GlobalOrderSampler) and stateful(part):
            return part
    return None


def in_global_order(loader: Any, rank: int, size: int, warned: set[str]) -> Any:
    """The loader with one global order split over `size` data-parallel ranks (see above);
    `warned` holds what was already warned about (one warning per kind of loader)."""
    if not isinstance(loader, DataLoader):
        return loader
    sampler = loader.sampler
    if isinstance(sampler, GlobalOrderSampler):
        bind(loader, rank, size)
        return loader
    if isinstance(loader.dataset, IterableDataset):
        warn_inexact(loader, "an iterable dataset", warned)
        return loader
    plain = (type(sampler) is SequentialSampler) or (
        type(sampler) is RandomSampler
        and not sampler.replacement
        and sampler._num_samples is None
        and sampler.generator is None
    )
    indexed = type(loader.batch_sampler).__name__ == "_IndexBatchSamplerWrapper"
    if plain and indexed:  # Lightning's predict loop records each batch's dataset indices
        return in_global_order_indexed(loader, rank, size)
    if (
        plain
        and loader.batch_sampler is not None
        and type(loader.batch_sampler).__name__ == "BatchSampler"
    ):
        order = GlobalOrderSampler(
            len(loader.dataset),
            shuffle=isinstance(sampler, RandomSampler),
            seed=int(os.environ.get("PL_GLOBAL_SEED", 0)),
            drop_last=loader.drop_last,
            num_replicas=size,
            rank=rank,
        )
        return _replace_sampler(loader, order)
    if isinstance(sampler, DistributedSampler):
        return loader  # the task distributes its data itself
    warn_inexact(loader, f"its sampler {type(sampler).__name__}", warned)
    if size > 1:
        from lightning.pytorch.overrides.distributed import DistributedSamplerWrapper

        wrapped = DistributedSamplerWrapper(sampler, num_replicas=size, rank=rank, shuffle=False)
        return _replace_sampler(loader, wrapped)
    return loader


def in_global_order_indexed(loader: DataLoader, rank: int, size: int) -> DataLoader:
    """A prediction loader (Lightning wraps its batch sampler to record the indices of every
    batch): the wrapped batch sampler draws from this rank's share of the dataset, in order,
    every rank as many batches (the last samples repeated: every rank of a sharded model must
    run each forward)."""
    from torch.utils.data import BatchSampler

    wrapper = loader.batch_sampler
    inner = wrapper._batch_sampler
    order = GlobalOrderSampler(
        len(loader.dataset), shuffle=False, drop_last=False, num_replicas=size, rank=rank
    )
    wrapper._batch_sampler = BatchSampler(order, inner.batch_size, drop_last=False)
    return loader


def _replace_sampler(loader: DataLoader, sampler) -> DataLoader:
    from lightning.pytorch.utilities.data import _update_dataloader

    return _update_dataloader(loader, sampler)


def warn_inexact(loader: Any, what: str, warned: set[str]) -> None:
    if resumable_part(loader) is not None or what in warned:
        return
    warned.add(what)
    log.warning(
        "A data loader with %s: its position is not saved, so a resume in the middle of an "
        "epoch does not continue exactly. Give the sampler (or dataset) state_dict() and "
        "load_state_dict() to make it exact.",
        what,
    )
