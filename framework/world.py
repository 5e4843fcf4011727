"""The shape of a job: how many processes, on what kind of device, and which one this is."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class World:
    """Process layout of a job, known before launch (rank 0) and inside each worker."""

    world_size: int
    devices: int
    num_nodes: int
    accelerator: str  # "cpu" or "cuda": what `auto` resolved to
    rank: int = 0
    local_rank: int = 0

    @property
    def is_cuda(self) -> bool:
        return self.accelerator == "cuda"

    @classmethod
    def planned(cls, trainer_cfg) -> World:
        """The world a trainer config asks for, as seen from the launching process."""
        accel = resolve_accelerator(trainer_cfg.accelerator)
        devices = int(trainer_cfg.devices)
        nodes = int(trainer_cfg.num_nodes)
        return cls(world_size=devices * nodes, devices=devices, num_nodes=nodes, accelerator=accel)

    @classmethod
    def current(cls, trainer_cfg) -> World:
        """The world of a running worker, read from the launcher's environment variables."""
        planned = cls.planned(trainer_cfg)
        return cls(
            world_size=int(env("WORLD_SIZE", "SLURM_NTASKS", planned.world_size)),
            devices=planned.devices,
            num_nodes=planned.num_nodes,
            accelerator=planned.accelerator,
            rank=int(env("RANK", "SLURM_PROCID", 0)),
            local_rank=int(env("LOCAL_RANK", "SLURM_LOCALID", 0)),
        )


def env(name: str, slurm_name: str, default):
    """A torchrun variable, else its SLURM equivalent (srun sets only those), else `default`."""
    return os.environ.get(name, os.environ.get(slurm_name, default))


RESTART_ENV = "FW_RESTART_COUNT"  # set by launcher=local: which start of the job this is


def global_rank() -> int:
    return int(env("RANK", "SLURM_PROCID", 0))


def resolve_accelerator(name: str) -> str:
    """Map the accelerator setting to the device type actually used: `cpu` or `cuda`."""
    if name == "cpu":
        return "cpu"
    if name in ("gpu", "cuda"):
        return "cuda"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def cuda_device_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def collective_backend(choice: str | None, world: World) -> str:
    """The collective backend of a job: the one asked for, else NCCL on CUDA and gloo on CPU;
    a ConfigError for NCCL without CUDA. Every strategy plugin asks here."""
    if choice == "nccl" and not world.is_cuda:
        from framework.errors import ConfigError

        raise ConfigError(
            "strategy.backend",
            choice,
            "NCCL needs CUDA devices but the job runs on CPU",
            ["gloo", "null"],
        )
    return choice or ("nccl" if world.is_cuda else "gloo")


def local_device(world: World):
    """This process's torch device: its GPU (by local rank) on CUDA, else the CPU."""
    import torch

    return torch.device("cuda", world.local_rank) if world.is_cuda else torch.device("cpu")
