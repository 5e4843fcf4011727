"""`launcher=local`: one worker per device on this machine, started by torch's elastic launch.

This is the machinery torchrun uses (rendezvous, worker monitoring, error files), driven from
Python: the workers run `python -m framework.worker RUN_DIR/config.yaml`, never `sys.argv` again.
When a worker fails, the others are stopped within `shutdown_timeout` seconds and the failure is
reported with the rank, its exit code and its exception.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

from framework.config.fields import doc
from framework.errors import ConfigError
from framework.world import World

__all__ = ["Config", "WorkerFailure", "WorkersPreempted", "build", "validate"]

PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
PREEMPTED_EXIT = 75


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


class WorkersPreempted(RuntimeError):
    """The workers stopped on SIGTERM/SIGUSR1 after saving a checkpoint."""

    exit_code = 75


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

    def launch(config_path: Path, resume_from: Path | None = None) -> None:
        args = ["-m", "framework.worker", str(config_path)]
        if resume_from is not None:
            args += ["--resume", str(resume_from)]
        with forward_signals(PREEMPT_SIGNALS):
            start_workers(cfg, world, args)

    return launch


@contextlib.contextmanager
def forward_signals(signums):
    """While workers run, pass SIGTERM/SIGUSR1 on to them (they checkpoint, then exit 75)."""
    previous = {s: signal.getsignal(s) for s in signums}

    def forward(signum, frame):
        for pid in child_pids(os.getpid()):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    for s in signums:
        signal.signal(s, forward)
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def child_pids(parent: int) -> list[int]:
    """Direct children of a process (from /proc; empty where /proc is missing)."""
    pids = []
    for entry in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = entry.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == parent:
            pids.append(int(entry.parent.name))
    return pids


def start_workers(cfg: Config, world: World, args: list[str]) -> None:
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
        signals_to_handle="SIGINT,SIGHUP,SIGQUIT",  # SIGTERM/SIGUSR1 mean: checkpoint, then stop
        logs_specs=DefaultLogsSpecs(log_dir=tempfile.mkdtemp(prefix="fw-elastic-")),
    )
    try:
        elastic_launch(launch_config, sys.executable)(*args)
    except ChildFailedError as err:
        codes = {f.exitcode for f in err.failures.values()}
        if PREEMPTED_EXIT in codes and codes <= {PREEMPTED_EXIT, -signal.SIGTERM}:
            raise WorkersPreempted(
                "preempted: a checkpoint was saved; run the same command to continue"
            ) from None
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
