"""`launcher=local`: one worker per device on this machine, started by torch's elastic launch.

This is the machinery torchrun uses (rendezvous, worker monitoring, error files), driven from
Python: the workers run `python -m framework.worker RUN_DIR/config.yaml`, never `sys.argv` again.
When a worker fails, the others are stopped within `shutdown_timeout` seconds and the failure is
reported with the rank, its exit code and its exception.
"""

from __future__ import annotations

import sys
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

from framework.config.fields import doc
from framework.errors import ConfigError
from framework.world import World

__all__ = ["Config", "WorkerFailure", "build", "validate"]


@dataclass
class Config:
    """Start one worker process per device on this machine with torch's elastic launch."""

    kind: str = doc("local", "Launcher plugin.")
    monitor_interval: float = doc(0.1, "Seconds between checks of the workers' health.")
    shutdown_timeout: int = doc(5, "Seconds the other ranks get to exit after one fails.")
    processes_per_core: int = doc(
        2, "On CPU, the most worker processes allowed per core (trainer.devices is checked)."
    )
    rdzv_endpoint: str = doc("localhost:0", "Rendezvous address (port 0: any free port).")


class WorkerFailure(RuntimeError):
    """One or more worker processes failed; the message names each rank and its error."""


def validate(cfg: Config, world: World) -> None:
    if world.num_nodes > 1:
        raise ConfigError(
            "trainer.num_nodes",
            world.num_nodes,
            "launcher=local starts processes on this machine only",
            hint="For several machines, start `fw train` on each with torchrun or srun; the runner "
            "then joins that job instead of spawning.",
        )


def build(cfg: Config, world: World):
    """A function that starts the job's workers and waits for them."""

    def launch(config_path: Path) -> None:
        start_workers(cfg, world, config_path)

    return launch


def start_workers(cfg: Config, world: World, config_path: Path) -> None:
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    launch_config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=world.devices,
        run_id=f"fw-{uuid.uuid4().hex[:12]}",
        rdzv_backend="c10d",
        rdzv_endpoint=cfg.rdzv_endpoint,
        max_restarts=0,
        monitor_interval=cfg.monitor_interval,
        start_method="spawn",
        shutdown_timeout=cfg.shutdown_timeout,
        logs_specs=DefaultLogsSpecs(log_dir=tempfile.mkdtemp(prefix="fw-elastic-")),
    )
    try:
        elastic_launch(launch_config, sys.executable)("-m", "framework.worker", str(config_path))
    except ChildFailedError as err:
        raise WorkerFailure(describe_failures(err)) from None


def describe_failures(err) -> str:
    """'rank N failed (exit code C): ExceptionType: message' for each failed rank, first first."""
    lines = []
    for rank, failure in sorted(err.failures.items(), key=lambda kv: kv[1].timestamp):
        code = failure.exitcode
        how = f"exit code {code}" if code >= 0 else f"killed by signal {failure.signal_name()}"
        message = failure.message
        if isinstance(message, dict):
            message = message.get("message", "")
        if not message or str(message).startswith("To enable traceback"):
            message = "no Python exception recorded (see its output above)"
        lines.append(f"rank {rank} failed ({how}): {str(message).strip()}")
    return "\n".join(lines)
