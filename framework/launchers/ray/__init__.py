"""`launcher=ray`: the job's ranks as Ray actors on a Ray cluster (KubeRay, Anyscale, `ray start`).

`fw` composes and checks the config once, as always; validation also reaches the cluster
(`launcher.address`, else RAY_ADDRESS, else a new cluster on this machine): its head's port must
answer within `probe_timeout_s` (Ray alone retries a silent address for minutes), and the
cluster must hold `trainer.num_nodes x trainer.devices` bundles (one per rank: `cpus_per_rank`
CPUs, and a GPU on CUDA), whatever the devices of the machine `fw` runs on (`checks_devices`).
On a cluster of several nodes, `run.dir` must be seen by every node: a probe file written next
to it must be read back on each node, else the job is refused.

The bundles are reserved in one placement group (`launcher.strategy`), one actor per bundle.
Each actor runs the ordinary worker entry with the environment a local worker gets from
torch's elastic launch (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT of rank 0's node, ...);
ranks are numbered node by node, so local ranks are contiguous. Their output reaches this
console through Ray, each line prefixed with its rank. When an actor fails (or its node is
lost) the others are stopped and, while `max_restarts` allows, every rank starts again from the
newest complete checkpoint. SIGTERM/SIGINT/SIGUSR1 to `fw` reach every rank (as SIGTERM for
SIGINT): they save at the next step and `fw` exits 75; no actor outlives `fw`. The hang watchdog
of launcher=local (framework.watchdog) watches every node's beats in the shared run directory.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from framework.launch.restarts import with_restarts
from framework.launchers.ray.cluster import (
    check_resources,
    check_shared,
    cluster_address,
    connect,
    probe,
)
from framework.launchers.ray.ranks import Attempt
from framework.launchers.ray.settings import Config
from framework.world import World

if TYPE_CHECKING:
    from framework.config.job_plan import JobPlan

log = logging.getLogger("framework.launcher")

__all__ = ["Config", "build", "checks_devices", "join", "validate"]


def validate(cfg: Config, world: World) -> None:
    """The address answers, Ray connects, and the cluster can hold every rank's bundle."""
    address, key = cluster_address(cfg)
    if address not in ("local", "auto"):
        probe(address, key, cfg.probe_timeout_s)
    connect(address, key, world, cfg)
    check_resources(cfg, world)


def checks_devices(cfg: Config) -> bool:
    """The ranks run on the cluster's nodes, not where `fw` runs: `validate` holds
    `trainer.devices` to the cluster's resources (GPUs too), not to this machine's."""
    return True


def join(cfg: Config, world: World, config: dict) -> bool:
    """One fw process writes the run directory; on a cluster of several nodes it must be one
    every node sees (checked before it is written)."""
    connect(*cluster_address(cfg), world, cfg)  # again after the previous job of a sweep
    check_shared(Path(config["run"]["dir"]), cfg.probe_timeout_s)
    return True


def build(cfg: Config, plan: JobPlan):
    """A function that runs the job's ranks on the cluster and waits for them (restarting them
    from the newest checkpoint while `max_restarts` allows)."""
    world = plan.world

    def launch(config_path: Path, resume_from: Path | None = None) -> None:
        import ray

        address, key = cluster_address(cfg)
        connect(address, key, world, cfg)
        run_dir = config_path.parent
        try:
            with_restarts(
                cfg.max_restarts,
                run_dir,
                resume_from,
                lambda attempt, resume: Attempt(cfg, world, run_dir, attempt).run(
                    config_path, resume
                ),
            )
        finally:
            ray.shutdown()  # a cluster started here stops with it

    return launch
