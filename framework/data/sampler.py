"""A distributed sampler whose order depends only on (seed, epoch), never on the process count.

Every epoch has one global order (a seeded permutation, or 0..n-1 without shuffling). Rank r of W
takes positions r, r+W, r+2W, ... of it, so the W per-rank batches of one step together hold
exactly the samples a single process would take with a W times larger batch. `resume_at(epoch,
start)` skips the `start` samples (all ranks together) that epoch had already consumed, so a run
continues mid-epoch, with any number of processes.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import DistributedSampler


class GlobalOrderSampler(DistributedSampler):
    """Shards one seeded global order over ranks; a DistributedSampler so Lightning keeps it.

    Without explicit `num_replicas`/`rank` the sampler is bound by the framework's strategies to
    the data-parallel coordinates (`bind`; tensor-parallel ranks of one group share the data);
    unbound, it uses the torch.distributed world (or one process).
    """

    def __init__(
        self,
        num_samples: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
        num_replicas: int | None = None,
        rank: int | None = None,
    ) -> None:
        # DistributedSampler.__init__ needs a dataset; only the attributes matter here.
        self._replicas = num_replicas
        self._rank = rank
        self.explicit = num_replicas is not None or rank is not None
        self.total = num_samples
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self.resume_epoch = -1
        self.resume_start = 0

    @property
    def num_replicas(self) -> int:
        return self._replicas if self._replicas is not None else _world()[1]

    @num_replicas.setter
    def num_replicas(self, value: int) -> None:
        self._replicas = value

    @property
    def rank(self) -> int:
        return self._rank if self._rank is not None else _world()[0]

    @rank.setter
    def rank(self, value: int) -> None:
        self._rank = value

    def global_order(self) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.total)
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.total, generator=generator)

    def _remaining(self) -> torch.Tensor:
        start = self.resume_start if self.epoch == self.resume_epoch else 0
        rest = self.global_order()[start:]
        world = self.num_replicas
        if self.drop_last:
            return rest[: len(rest) - len(rest) % world]
        pad = (-len(rest)) % world
        return torch.cat([rest, rest[:pad]]) if pad and len(rest) else rest

    def __iter__(self) -> Iterator[int]:
        return iter(self._remaining()[self.rank :: self.num_replicas].tolist())

    def __len__(self) -> int:
        return len(self._remaining()) // self.num_replicas

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def resume_at(self, epoch: int, start: int) -> None:
        """Skip the first `start` samples of `epoch`'s global order (already trained on)."""
        self.resume_epoch = epoch
        self.resume_start = start


def _world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def bind(loader, rank: int, size: int) -> None:
    """Give the loader's GlobalOrderSampler (unless built with explicit coordinates) this rank's
    data-parallel coordinates: `size` ranks read different data, this one is `rank`."""
    samplers = (
        getattr(loader, "sampler", None),
        getattr(getattr(loader, "batch_sampler", None), "sampler", None),
    )
    for sampler in samplers:
        if isinstance(sampler, GlobalOrderSampler) and not sampler.explicit:
            sampler.num_replicas, sampler.rank = size, rank
