"""`strategy=hogwild`: worker processes of one machine update shared parameters without locks.

The model's parameters live once, in shared memory (framework/strategies/hogwild/shared.py).
Each of the `trainer.devices` worker processes runs the task's own optimizer on its own shard of
the global data order and writes its steps straight into that memory, with no gradient
all-reduce and no lock (Hogwild!, Recht et al. 2011): a worker computes its gradient on
parameters that the others may be changing at that moment. CPU on one machine only.

Checkpoints are ddp's Lightning file, taken with every worker stopped; they also hold each
worker's own optimizer state (framework/strategies/hogwild/strategy.py).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from framework.config.fields import doc
from framework.errors import ConfigError
from framework.world import World, local_device


@dataclass
class Config:
    """Hogwild!: lock-free updates of parameters shared by the processes of one CPU machine
    (no other parallel degree: the parameters are whole in one place)."""

    kind: str = doc("hogwild", "Strategy plugin.")
    shm_dir: str = doc(
        "/dev/shm", "Directory (a tmpfs: memory) of the file the shared parameters are mapped from."
    )
    timeout_s: int = doc(1800, "Seconds a barrier or gather may wait before the job fails.", min=1)


def validate(cfg: Config, world: World, job: Any) -> None:
    if world.is_cuda:
        raise ConfigError(
            "trainer.accelerator",
            job.trainer.accelerator,
            "strategy=hogwild runs on the CPU only: its workers write into parameters kept in "
            "the shared memory of one machine, in place and without locks, and CUDA tensors "
            "cannot be updated that way from several processes",
            ["cpu"],
            hint="Use strategy=ddp or strategy=diloco on GPUs.",
            near="",  # no "did you mean": gpu is not a misspelt cpu
        )
    if world.num_nodes > 1:
        raise ConfigError(
            "trainer.num_nodes",
            world.num_nodes,
            "strategy=hogwild shares the parameters through the memory of one machine, which "
            "processes on other machines cannot map",
            ["1"],
            hint="Use strategy=diloco (or ddp) across machines.",
        )
    if job.trainer.get("scale_lr", "none") != "none":
        raise ConfigError(
            "trainer.scale_lr",
            job.trainer.scale_lr,
            "under strategy=hogwild every update applies one worker's batch (nothing is "
            "averaged over workers), so the learning rate needs no scaling with their number",
            ["none"],
        )
    check_shm_dir(cfg, job.model)


def check_shm_dir(cfg: Config, model: Any) -> None:
    """The directory exists, is writable and has room for the parameters."""
    where = Path(cfg.shm_dir)
    if not where.is_dir() or not os.access(where, os.W_OK):
        raise ConfigError(
            "strategy.shm_dir",
            cfg.shm_dir,
            "not a writable directory",
            hint="Name a tmpfs directory (memory), e.g. /dev/shm.",
        )
    if model is None:
        return
    needed = sum(p.numel() * p.element_size() for p in model.parameters())
    free = shutil.disk_usage(where).free
    if needed > free:
        raise ConfigError(
            "strategy.shm_dir",
            cfg.shm_dir,
            f"{free / 2**20:.1f} MiB free there, less than the {needed / 2**20:.1f} MiB of "
            "parameters to share",
            hint="Enlarge it (docker run --shm-size) or name a tmpfs with more room.",
        )


def checkpoint_format(cfg: Config, world: World) -> str:
    return "lightning"  # ddp's file, plus every worker's optimizer state under "hogwild"


def check_move(cfg: Config, source: str) -> None:
    """Any layout can be moved in (whole tensors)."""


def data_parallel(cfg: Config, world: World) -> tuple[int, int]:
    return world.rank, world.world_size


def build(cfg: Config, world: World, inputs):
    from framework.strategies.hogwild.strategy import HogwildDDP, HogwildSingleDevice

    if world.world_size == 1:
        return HogwildSingleDevice(cfg, device=local_device(world), inputs=inputs)
    return HogwildDDP(
        cfg,
        inputs=inputs,
        process_group_backend="gloo",  # barriers and checkpoint gathers only
        timeout=timedelta(seconds=cfg.timeout_s),
    )
