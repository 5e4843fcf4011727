"""torchft replica groups (`strategy.fault_tolerance=torchft` under `strategy=ddp` and
`strategy=fsdp`): the settings and their checks (light: no torch).

Each `fw train` command is one replica group of `trainer.devices` processes on one machine,
`strategy.replica_group` of `strategy.replica_groups`, with its own run directory (every group
has the same number of processes); every group names the same torchft
lighthouse (`strategy.lighthouse`), which forms a quorum of the live groups at each step. Inside
a group the processes replicate the model (ddp) or shard it (fsdp); across the groups each
process averages its gradients (or its gradient shards) with the process of the same rank in the
others. The step, the quorum and the heal are framework/replica_groups/steps.py.
"""

from __future__ import annotations

import importlib.util
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlsplit

from framework.config.fields import doc
from framework.config.schema import CollectiveSettings
from framework.errors import ConfigError
from framework.world import World

FAULT_TOLERANCE = ("none", "torchft")
START_LIGHTHOUSE = (
    "Start one with torchft's `torchft_lighthouse --min_replicas 1 --join_timeout_ms 10000 "
    "--bind [::]:29510` (installed with the torchft extra) and pass "
    "strategy.lighthouse=HOST:29510."
)


@dataclass
class TorchftSettings(CollectiveSettings):
    """The settings of a strategy whose `fw train` commands can be torchft replica groups."""

    fault_tolerance: str = doc(
        "none",
        "torchft: replica groups (one fw train command each) that go on when one dies and heal "
        "it from a live peer (docs/cluster.md).",
        FAULT_TOLERANCE,
    )
    lighthouse: str = doc("", "torchft: the lighthouse's HOST:PORT (torchft_lighthouse).")
    replica_group: int = doc(0, "torchft: this command's group, 0 .. replica_groups-1.", min=0)
    replica_groups: int = doc(
        1, "torchft: the number of groups; each reads its share of the global order.", min=1
    )
    min_replicas: int = doc(1, "torchft: the fewest live groups a step commits with.", min=1)
    fault_timeout_s: int = doc(
        60,
        "torchft: seconds a step's all-reduce, commit vote or heal waits on other groups.",
        min=1,
    )
    groups_per_machine: int = doc(
        1,
        "torchft on CUDA: replica groups started on one machine (consecutive group numbers); "
        "each takes its own trainer.devices GPUs, group g from GPU (g mod groups_per_machine) x "
        "trainer.devices on.",
        min=1,
    )


def data_parallel(cfg: Any, world: World) -> tuple[int, int]:
    """This process's (rank, size) among the readers of different data: the groups' processes
    read in turn, group by group (group g's rank r is g*N + r of groups*N)."""
    group = cfg.replica_group * world.world_size
    return group + world.rank, cfg.replica_groups * world.world_size


def first_gpu(cfg: Any, devices: int, group: int | None = None) -> int:
    """The GPU index this replica group's local rank 0 takes (its processes take the next
    `devices`): groups sharing a machine (`groups_per_machine`) take GPUs of their own; 0
    without torchft."""
    if cfg.fault_tolerance != "torchft":
        return 0
    group = cfg.replica_group if group is None else group
    return (group % cfg.groups_per_machine) * devices


def gpu_placement(cfg: Any, world: World) -> dict[str, list[tuple[str, int]]]:
    """The (machine, GPU) of every member of every NCCL group of a torchft job on CUDA: each
    group's own processes, and the processes of rank r of every group, which torchft's NCCL
    group joins (consecutive groups of `groups_per_machine` share a machine)."""
    groups, n, k = cfg.replica_groups, world.devices, cfg.groups_per_machine

    def place(group: int, rank: int) -> tuple[str, int]:
        return f"machine {group // k}", first_gpu(cfg, n, group) + rank

    placed = {f"replica group {g}": [place(g, r) for r in range(n)] for g in range(groups)}
    for r in range(n):
        placed[f"torchft's group of rank {r}"] = [place(g, r) for g in range(groups)]
    return placed


def claim_gpu(identity: str, holder: str, directory: str | None = None) -> IO[str]:
    """This machine's claim on one GPU (`identity`: its UUID) for a process of a replica group,
    held while the returned file is open (released when the process ends): a second group's
    process started on the same GPU is refused here, naming the first (`holder`), instead of
    NCCL refusing torchft's group at every step, where no step would ever commit."""
    import fcntl
    import tempfile

    path = Path(directory or tempfile.gettempdir()) / f"fw-torchft-gpu-{identity}.lock"
    claim = path.open("a+")
    try:
        fcntl.flock(claim, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        claim.seek(0)
        first = claim.read().strip() or "another process"
        claim.close()
        raise RuntimeError(
            f"strategy.fault_tolerance=torchft: this GPU ({identity}) already runs {first}: "
            "replica groups on one machine need GPUs of their own (NCCL refuses two members "
            "of a group on one GPU); set strategy.groups_per_machine to the number of groups "
            "started on this machine, or give each command its own CUDA_VISIBLE_DEVICES"
        ) from None
    claim.seek(0)
    claim.truncate()
    claim.write(holder)
    claim.flush()
    return claim


def lighthouse_url(address: str) -> str:
    """`HOST:PORT` or `http://HOST:PORT` as the URL torchft's Manager takes."""
    return address if "://" in address else f"http://{address}"


def validate(cfg: Any, world: World) -> None:
    """Refuse, before launch, what torchft replica groups cannot run."""
    if cfg.fault_tolerance not in FAULT_TOLERANCE:  # out-of-tree configs are typed here
        raise ConfigError(
            "strategy.fault_tolerance", cfg.fault_tolerance, "no such mode", FAULT_TOLERANCE
        )
    if cfg.fault_tolerance == "none":
        return
    if importlib.util.find_spec("torchft") is None:
        raise ConfigError(
            "strategy.fault_tolerance",
            cfg.fault_tolerance,
            "torchft is not installed",
            hint="Install it with `pip install 'framework[torchft]'` (make install does).",
        )
    if world.num_nodes != 1:
        raise ConfigError(
            "trainer.num_nodes",
            world.num_nodes,
            "strategy.fault_tolerance=torchft runs each replica group on one machine: each "
            "`fw train` command is one group (of trainer.devices processes), and the groups "
            "average their gradients through torchft",
            ["1"],
            hint="Start one command per replica group, each with trainer.num_nodes=1 and its "
            "own strategy.replica_group and run.dir.",
        )
    if cfg.replica_group >= cfg.replica_groups:
        raise ConfigError(
            "strategy.replica_group",
            cfg.replica_group,
            f"groups are numbered 0 .. strategy.replica_groups-1 = {cfg.replica_groups - 1}",
            [str(g) for g in range(cfg.replica_groups)],
        )
    if cfg.min_replicas > cfg.replica_groups:
        raise ConfigError(
            "strategy.min_replicas",
            cfg.min_replicas,
            f"more than the strategy.replica_groups={cfg.replica_groups} that exist: no step "
            "could ever commit",
            hint=f"Use 1 .. {cfg.replica_groups}.",
        )
    lighthouse_host_port(cfg.lighthouse)
    if world.is_cuda:
        check_gpus(cfg, world)


def check_gpus(cfg: Any, world: World) -> None:
    """On CUDA no two members of an NCCL group may share a GPU (NCCL refuses, and torchft's
    group then never commits a step): the groups that share a machine fit its GPUs side by
    side."""
    from framework.parallel.nccl_rules import shared_devices
    from framework.world import cuda_device_count

    k = cfg.groups_per_machine
    if k > cfg.replica_groups:
        raise ConfigError(
            "strategy.groups_per_machine",
            k,
            f"more than the strategy.replica_groups={cfg.replica_groups} that exist",
            hint=f"Use 1 .. {cfg.replica_groups}.",
        )
    visible = cuda_device_count()
    if visible and k * world.devices > visible:
        raise ConfigError(
            "strategy.groups_per_machine",
            k,
            f"{k} groups of trainer.devices={world.devices} GPUs need {k * world.devices} GPUs "
            f"on this machine, which has {visible} (CUDA_VISIBLE_DEVICES counted)",
            hint="Start fewer groups on this machine, or give each command its own "
            "CUDA_VISIBLE_DEVICES and keep strategy.groups_per_machine=1.",
        )
    shared = shared_devices(gpu_placement(cfg, world))
    if shared:
        raise ConfigError(
            "strategy.groups_per_machine",
            k,
            f"replica groups would share a GPU: {shared[0]}",
            hint="Each group of a machine needs GPUs of its own.",
        )


def lighthouse_host_port(address: str) -> tuple[str, int]:
    """The host and port of `strategy.lighthouse`; ConfigError when it is empty or not of the
    form HOST:PORT."""
    if not address:
        raise ConfigError(
            "strategy.lighthouse",
            address,
            "strategy.fault_tolerance=torchft needs the address of a running torchft "
            "lighthouse, which forms the quorum of live replica groups",
            hint=START_LIGHTHOUSE,
        )
    parts = urlsplit(lighthouse_url(address))
    try:
        host, port = parts.hostname, parts.port
    except ValueError:
        host = port = None
    if not host or not port:
        raise ConfigError("strategy.lighthouse", address, "not an address of the form HOST:PORT")
    return host, port


def contact_lighthouse(address: str) -> None:
    """A lighthouse answers at `address` (a TCP connection is accepted within 3 s): asked by
    `fw train` before launch (the strategies' `check_services`)."""
    host, port = lighthouse_host_port(address)
    try:
        socket.create_connection((host, port), timeout=3).close()
    except OSError as err:
        raise ConfigError(
            "strategy.lighthouse",
            address,
            f"no lighthouse answers there ({err.strerror or err})",
            hint=START_LIGHTHOUSE,
        ) from None
