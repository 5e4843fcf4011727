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
from typing import Any
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


def data_parallel(cfg: Any, world: World) -> tuple[int, int]:
    """This process's (rank, size) among the readers of different data: the groups' processes
    read in turn, group by group (group g's rank r is g*N + r of groups*N)."""
    group = cfg.replica_group * world.world_size
    return group + world.rank, cfg.replica_groups * world.world_size


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
