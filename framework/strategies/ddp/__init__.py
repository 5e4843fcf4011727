"""`strategy=ddp`: data parallel with replicated parameters and all-reduced gradients.

gloo on CPU, NCCL on CUDA. With one process in total it uses Lightning's single-device strategy,
which runs the same numerics without the wrapper and collective overhead.

With `fault_tolerance=torchft` each `fw train` command is one replica group (of
`trainer.devices` processes, ddp inside); the groups average their gradients through torchft,
go on when one dies and heal it from a live peer when it comes back
(framework/replica_groups, shared with strategy=fsdp; the Lightning classes:
framework/strategies/ddp/replica_groups.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from framework import replica_groups as torchft_groups  # not .replica_groups, our module
from framework.config.fields import doc
from framework.world import World, collective_backend, local_device, parallel_devices


@dataclass
class Config(torchft_groups.TorchftSettings):
    """Distributed data parallel (torch DDP)."""

    kind: str = doc("ddp", "Strategy plugin.")
    find_unused_parameters: bool = doc(False, "Allow parameters that get no gradient in a step.")
    static_graph: bool = doc(
        False, "Promise the graph is the same every step (enables optimizations)."
    )
    gradient_as_bucket_view: bool = doc(
        True, "Gradients alias the all-reduce buckets (saves memory)."
    )
    bucket_cap_mb: int = doc(25, "Size of gradient buckets all-reduced together, in MiB.", min=1)


def plan_candidates(gpus: int, tp_limit: int) -> list[tuple[str, list[str]]]:
    """`fw plan` tries plain data parallel."""
    return [("ddp", ["strategy=ddp"])]


def validate(cfg: Config, world: World, job: Any) -> None:
    collective_backend(cfg.backend, world)
    torchft_groups.validate(cfg, world)


def check_services(cfg: Config, world: World) -> None:
    if cfg.fault_tolerance == "torchft":  # `fw train` only: check and plan do not need it up
        torchft_groups.contact_lighthouse(cfg.lighthouse)


def data_traffic(cfg: Config, world: World, grads: int, params: int) -> float:
    """An all-reduce of the gradients (ring volume); with torchft and a group of several
    processes, a second one: each process's with its peers in the other groups."""
    passes = 2 if cfg.fault_tolerance == "torchft" and world.world_size > 1 else 1
    return passes * 2 * grads


def checkpoint_format(cfg: Config, world: World) -> str:
    return "lightning"  # one file; loads under any process count


def check_move(cfg: Config, source: str) -> None:
    """Any layout can be moved into ddp (whole tensors)."""


def data_parallel(cfg: Config, world: World) -> tuple[int, int]:
    if cfg.fault_tolerance == "torchft":
        return torchft_groups.data_parallel(cfg, world)
    return world.rank, world.world_size


def build(cfg: Config, world: World, inputs):
    from framework.strategies.ddp.strategy import PortableDDP, PortableSingleDevice

    torchft = cfg.fault_tolerance == "torchft"
    first = torchft_groups.first_gpu(cfg, world.devices)  # groups sharing a machine: own GPUs
    if torchft and world.world_size == 1:
        from framework.strategies.ddp.replica_groups import ReplicaGroup

        return ReplicaGroup(cfg, device=local_device(world, first), inputs=inputs)
    if world.world_size == 1:
        return PortableSingleDevice(device=local_device(world), inputs=inputs)
    ddp = dict(
        inputs=inputs,
        process_group_backend=collective_backend(cfg.backend, world),
        timeout=timedelta(seconds=cfg.timeout_s),
        find_unused_parameters=cfg.find_unused_parameters,
        static_graph=cfg.static_graph,
        gradient_as_bucket_view=cfg.gradient_as_bucket_view,
        bucket_cap_mb=cfg.bucket_cap_mb,
    )
    if torchft:  # DDP inside the group, torchft across the groups
        from framework.strategies.ddp.replica_groups import ReplicaGroupDDP

        return ReplicaGroupDDP(cfg, parallel_devices=parallel_devices(world, first), **ddp)
    return PortableDDP(**ddp)
