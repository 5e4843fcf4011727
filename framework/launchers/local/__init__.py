"""`launcher=local`: one worker per device on this machine, started by torch's elastic launch.

This is the machinery torchrun uses (rendezvous, worker monitoring, error files), driven from
Python: each worker enters through `framework.worker.entry` (forked from the `fw` process, or
spawned as `python -m framework.worker RUN_DIR/config.yaml`), never `sys.argv` again.
When a worker fails, the others are stopped within `shutdown_timeout` seconds and the failure is
reported with the rank, its exit code and its exception; with `max_restarts` the workers are then
started again from the newest complete checkpoint. A watchdog (framework.watchdog) ends a job
whose ranks stop making progress, with every rank's stack in the run directory.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import secrets
import shutil
import signal
import tempfile
import uuid
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from framework import stores
from framework.checkpoint import disk
from framework.config.fields import doc
from framework.errors import EXIT_PREEMPTED, EXIT_TERMINATED, ConfigError
from framework.launch import rendezvous
from framework.launch.outcomes import WorkersPreempted, describe_failures, preempted_message
from framework.launch.preload import Preload
from framework.launch.restarts import (
    WorkerFailure,
    after,
    check_restart,
    record_restart,
    with_restarts,
)
from framework.launch.signals import PREEMPT_SIGNALS, child_pids, forward_signals, signal_workers
from framework.logs import scrub_every_handler
from framework.processes import python
from framework.watchdog import HEARTBEAT_ENV, WATCHED, ExitWatch, Watchdog
from framework.world import RESTART_ENV, World

if TYPE_CHECKING:
    from framework.config.job_plan import JobPlan

log = logging.getLogger("framework.launcher")

GLOO_IFNAME = "GLOO_SOCKET_IFNAME"

__all__ = ["Config", "WorkerFailure", "WorkersPreempted", "build", "join", "validate"]


@dataclass
class Config:
    """Start one worker process per device on this machine with torch's elastic launch."""

    kind: str = doc("local", "Launcher plugin.")
    monitor_interval: float = doc(0.1, "Seconds between checks of the workers' health.", above=0)
    shutdown_timeout: int = doc(5, "Seconds the other ranks get to exit after one fails.", min=0)
    processes_per_core: int = doc(
        2, "On CPU, the most worker processes allowed per core (trainer.devices is checked).", min=1
    )
    rdzv_endpoint: str = doc(
        "localhost:0",
        "Rendezvous address host:port (port 0: any free port, one machine only). With "
        "trainer.num_nodes > 1, a fixed address every node reaches; the node whose host it "
        "names keeps the rendezvous store.",
    )
    rdzv_id: str = doc(
        "fw",
        "With trainer.num_nodes > 1: the job's name at the rendezvous, the same on every node.",
    )
    rdzv_token: str = doc(
        "",
        "With trainer.num_nodes > 1: a secret every node of the job shares (empty: the "
        "FW_RDZV_TOKEN environment variable, the better place for it); a node without it is "
        "refused.",
    )
    join_timeout_s: float = doc(
        600.0,
        "With trainer.num_nodes > 1: how long a node waits for the others to start.",
        above=0,
    )
    min_nodes: int | None = doc(
        None,
        "With trainer.num_nodes > 1: the fewest nodes the job goes on with when one is lost "
        "(its fw process or machine gone): the others continue from the newest checkpoint with "
        "the same global batch, and a node whose command is started again joins at the next "
        "step; each change counts against max_restarts (null: trainer.num_nodes, no shrinking).",
        min=1,
    )
    rejoin_wait_s: float = doc(
        3.0,
        "With min_nodes: how long the nodes left after a loss wait for more of them before "
        "going on with fewer.",
        above=0,
    )
    max_restarts: int = doc(
        0,
        "When a worker fails or the job hangs, stop every worker and start them again from the "
        "newest complete checkpoint, up to this many times (a preempted job is not restarted).",
        min=0,
    )
    hang_timeout_s: float = doc(
        300.0,
        "End (or restart) the job when a rank makes no training progress for this many seconds, "
        "after dumping every rank's Python stack into RUN_DIR/stacks (checkpoint saves and "
        "loads pause the clock; 0: no watchdog).",
        min=0,
    )
    fast_start: bool = doc(
        True,
        "On one machine, start workers the quick way: the workers' agent takes the store this "
        "process holds at once (not torch's dynamic rendezvous, which waits 0-0.3 s at random "
        "each start), forked workers get config.yaml as read here, and (when the job can start "
        "again: max_restarts > 0 or min_nodes) the modules a start's workers imported are "
        "imported here while they train, so a restart's workers find them; false: as before, "
        "to compare (benchmarks/kill_campaign.py --compare).",
    )
    start_method: str = doc(
        "auto",
        "fork: workers are copies of the fw process (no second import of torch and Lightning; "
        "CPU only); spawn: fresh interpreters; auto: fork on CPU, spawn on CUDA.",
        ("auto", "fork", "spawn"),
    )


def validate(cfg: Config, world: World) -> None:
    if cfg.start_method == "fork" and world.is_cuda:
        # The fw process has asked torch about CUDA (validation, device counts); CUDA cannot be
        # initialized again in a process forked after that, so every worker would fail.
        raise ConfigError(
            "launcher.start_method",
            cfg.start_method,
            "forked workers cannot use CUDA once the fw process has initialized it",
            ["auto", "spawn"],
        )
    if world.num_nodes > 1:
        host, _, port = cfg.rdzv_endpoint.rpartition(":")
        if not host or not port.isdigit() or int(port) == 0:
            raise ConfigError(
                "launcher.rdzv_endpoint",
                cfg.rdzv_endpoint,
                f"trainer.num_nodes={world.num_nodes} needs a fixed host:port that every node "
                "can reach",
                hint="Start the same command on every machine with e.g. "
                "launcher.rdzv_endpoint=node0.cluster:29500 and a run.dir they share.",
            )
    if cfg.min_nodes is not None and cfg.min_nodes > world.num_nodes:
        raise ConfigError(
            "launcher.min_nodes",
            cfg.min_nodes,
            f"more than trainer.num_nodes={world.num_nodes}",
            hint=f"Use 1 to {world.num_nodes} (null: {world.num_nodes}).",
        )
    if elastic(cfg, world) and cfg.max_restarts < 1:
        raise ConfigError(
            "launcher.max_restarts",
            cfg.max_restarts,
            f"launcher.min_nodes={cfg.min_nodes} goes on after losing a node by starting the "
            "others again, which counts as a restart: with none allowed the job ends at the "
            "first loss",
            hint="Allow as many as the losses to ride out, e.g. launcher.max_restarts=3.",
        )
    if world.num_nodes > 1 and not rendezvous.job_token(cfg.rdzv_token):
        raise ConfigError(
            "launcher.rdzv_token",
            "",
            f"trainer.num_nodes={world.num_nodes} needs a token every node shares, so that a "
            "stranger who reaches the rendezvous port cannot join",
            hint=f"Export the same {rendezvous.TOKEN_ENV} (e.g. from `openssl rand -hex 16`) "
            "on every node.",
        )


def join(cfg: Config, world: World, config: dict) -> bool:
    """Before anything is written: meet the other nodes of a job over several machines at the
    rendezvous store and check that every node composed the same config (ConfigError naming the
    first key that differs, or a node without the job's token). Returns whether this node writes
    the run directory (the first to arrive; a job on one machine always does)."""
    if world.num_nodes == 1:
        return True
    if elastic(cfg, world):  # before meeting anyone: a global batch a smaller world cannot keep
        from framework.config import elastic as elastic_batch

        elastic_batch.check(config, world, cfg.min_nodes)
    token = rendezvous.job_token(cfg.rdzv_token)
    try:
        arrival = rendezvous.join(
            cfg.rdzv_endpoint,
            cfg.rdzv_id,
            token,
            world.num_nodes,
            config,
            cfg.join_timeout_s,
            late=elastic(cfg, world),
        )
    except rendezvous.JoinTimeout as err:
        raise WorkerFailure(str(err)) from err
    return arrival == 0


def elastic(cfg: Config, world: World) -> bool:
    """Whether the job goes on with fewer nodes when one is lost."""
    return world.num_nodes > 1 and cfg.min_nodes is not None and cfg.min_nodes < world.num_nodes


def build(cfg: Config, plan: JobPlan):
    """A function that starts the job's workers and waits for them (restarting them on failure
    while `max_restarts` allows). One process trains in this one, from `plan`; worker processes
    make theirs from config.yaml."""
    world = plan.world

    def launch(config_path: Path, resume_from: Path | None = None) -> None:
        if world.world_size == 1 and not cfg.max_restarts:  # trains in this process
            from framework import worker

            worker.entry(config_path, resume_from, plan=plan)
            return
        method = cfg.start_method
        if method == "auto":
            # CUDA cannot be used in a forked child once the parent touched it.
            method = "spawn" if world.is_cuda else "fork"
        run_dir = config_path.parent
        if elastic(cfg, world):
            run_elastic(cfg, world, method, config_path, resume_from)
            return

        config = None
        if method == "fork" and cfg.fast_start:  # read once: each start's workers get a copy
            from omegaconf import OmegaConf

            config = OmegaConf.load(config_path)

        def start(attempt: int, resume_from: Path | None) -> str | None:
            os.environ[RESTART_ENV] = str(attempt)
            with forward_signals(PREEMPT_SIGNALS):
                args = worker_args(method, config_path, resume_from, config)
                return start_workers(cfg, world, method, args, run_dir)

        with_restarts(cfg.max_restarts, run_dir, resume_from, start)

    return launch


def run_elastic(
    cfg: Config,
    world: World,
    method: str,
    config_path: Path,
    resume_from: Path | None,
    signals: list[int] | None = None,
) -> None:
    """The workers of an elastic job, one generation after another (framework.launchers.
    elastic): after a lost node on the nodes left, after a node came back on all of them, each
    from the newest complete checkpoint, each change counted against max_restarts. `signals`:
    the preemption signals this process passed on are appended there."""
    from framework.launch.elastic import Watch, come_back

    token = rendezvous.job_token(cfg.rdzv_token)
    generations = rendezvous.Generations(cfg.rdzv_endpoint, token, cfg.rdzv_id, cfg.join_timeout_s)
    run_dir, restarts = config_path.parent, 0
    generation = generations.current()
    if generation > 0 or generations.count("members", 0) >= world.num_nodes:
        generation = come_back(generations, generation, world.num_nodes, cfg.join_timeout_s)
    while True:
        if generation > 0:
            resume_from = disk.newest_complete(run_dir / "checkpoints") or resume_from
            check_restart(run_dir, resume_from)  # as with_restarts checks it
        fewest = cfg.min_nodes if generation else world.num_nodes
        try:
            fewest = generations.expected(generation) or fewest
        except Exception as err:
            if stores.REFUSED in str(err):
                raise forged(cfg.rdzv_endpoint, str(err)) from None
            raise
        generations.count("members", generation, add=1)
        os.environ[RESTART_ENV] = str(restarts)
        watch = Watch(generations, generation, signal_workers)
        meeting = (f"{generations.name}-g{generation}", fewest, watch)
        try:
            with forward_signals(PREEMPT_SIGNALS, signals):
                args = worker_args(method, config_path, resume_from)
                failure = start_workers(cfg, world, method, args, run_dir, meeting)
        finally:
            with contextlib.suppress(RuntimeError, OSError):  # the store's node may be gone
                generations.count("stopped", generation, add=1)
        if failure is None:
            return
        if restarts == cfg.max_restarts:
            raise WorkerFailure(failure + after(restarts))
        restarts += 1
        log.warning("Restart %d of %d after: %s", restarts, cfg.max_restarts, failure)
        record_restart(run_dir, restarts, failure)
        generation = generations.advance(generation)


def forged(endpoint: str, what: str) -> ConfigError:
    """The refusal of a job whose store held a value without the job's signature."""
    return ConfigError(
        "launcher.rdzv_endpoint",
        endpoint,
        f"{what.rstrip('.')}; the job stopped",
        hint="A process that reached the store's port without the job's token tried to change "
        "what the nodes do. Keep the rendezvous port reachable only from the job's machines "
        "(a private network, a firewall) and the token secret.",
    )


def worker_args(
    method: str, config_path: Path, resume_from: Path | None, config: Any = None
) -> tuple:
    """The entry point and arguments of every worker (`config`: config.yaml as read here, for
    forked workers; None: each reads it)."""
    if method == "fork":
        from framework import worker

        return worker.entry, (str(config_path), str(resume_from or ""), "fork", None, config)
    # -P: a stray torch.py in the working directory does not shadow torch; the worker appends
    # the directory, as fw does, so the user's modules are found
    executable, *args = python("-m", "framework.worker", str(config_path))
    if resume_from is not None:
        args += ["--resume", str(resume_from)]
    return executable, tuple(args)


def start_workers(
    cfg: Config,
    world: World,
    method: str,
    entry: tuple,
    run_dir: Path,
    generation: tuple[str, int, Any] | None = None,
) -> str | None:
    """Run the workers once: None when they all finished, else what failed (raises
    WorkersPreempted when they stopped on a preemption signal). `generation` (elastic jobs):
    the rendezvous name, the fewest nodes it forms with, and a watch (framework.launchers.
    elastic.Watch) whose stop request ends these workers at their next step."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    attempt = os.environ.get(RESTART_ENV, "0")
    endpoint, run_id, local_addr, store = cfg.rdzv_endpoint, None, None, None
    backend, token = rendezvous.BACKEND, rendezvous.job_token(cfg.rdzv_token)
    min_nodes, watch, rdzv_configs = world.num_nodes, None, {"join_timeout": cfg.join_timeout_s}
    if generation is not None:  # an elastic job: the node count of this start is open
        run_id, min_nodes, watch = generation
        rdzv_configs["last_call_timeout"] = cfg.rejoin_wait_s
    elif world.num_nodes > 1:  # every node names the same rendezvous, derived from the token
        run_id = f"{rendezvous.meeting(token, cfg.rdzv_id)}-{attempt}"
    else:  # nobody else needs to reach this job: its stores listen on loopback only
        host, _, port = cfg.rdzv_endpoint.rpartition(":")
        address = rendezvous.address_of(host or "localhost")
        address = address if address.startswith("127.") or address == "::1" else "127.0.0.1"
        store = rendezvous.bound_store(address, int(port or 0), timedelta(seconds=60))
        endpoint, run_id, local_addr = f"{address}:{store.port}", f"fw-{uuid.uuid4().hex}", address
        backend = rendezvous.DIRECT if cfg.fast_start else backend
        # other users of this machine reach loopback too: each start signs with its own token
        token = secrets.token_hex(16)
    rendezvous.register_backend()
    rendezvous.use_token(run_id, token)

    several = world.num_nodes if store is None else 0  # nodes that meet at the endpoint

    def refused(failure: str) -> None:
        """ConfigError when this node refused a store value (a worker, its process group's; the
        agent, the rendezvous store's) or another node of the job did."""
        if stores.REFUSED in failure:
            if several:
                rendezvous.after_refusal(endpoint, run_id, token, failure, several)
            raise forged(endpoint, failure) from None
        elsewhere = rendezvous.refused_elsewhere(endpoint, run_id, token) if several else None
        if elsewhere is not None:
            raise forged(endpoint, f"another node of the job stopped: {elsewhere}") from None

    # the workers sign their process group's store with a key derived from it (forked workers
    # inherit this environment, spawned ones get it from the agent)
    os.environ[stores.STORE_KEY_ENV] = stores.store_key(token)
    # every node has trainer.devices workers: the agents compute the ranks, not read them
    os.environ[rendezvous.IDENTICAL_ENV] = "1"
    # gloo listens where the host name resolves (a node's network address, often): the workers
    # of a job on one machine listen on loopback, unless the user named an interface
    loopback_gloo = store is not None and GLOO_IFNAME not in os.environ
    if loopback_gloo:
        os.environ[GLOO_IFNAME] = "lo"
    log_dir = Path(tempfile.mkdtemp(prefix="fw-elastic-"))
    launch_config = LaunchConfig(
        min_nodes=min_nodes,
        max_nodes=world.num_nodes,
        nproc_per_node=world.devices,
        run_id=run_id,
        rdzv_backend=backend,
        rdzv_endpoint=endpoint,
        local_addr=local_addr,
        rdzv_configs={k: int(math.ceil(v)) for k, v in rdzv_configs.items()},
        max_restarts=0,  # restarts are ours: the agent would also restart preempted workers
        monitor_interval=cfg.monitor_interval,
        start_method=method,
        shutdown_timeout=cfg.shutdown_timeout,
        signals_to_handle="SIGINT,SIGHUP,SIGQUIT",  # SIGTERM/SIGUSR1 mean: checkpoint, then stop
        logs_specs=DefaultLogsSpecs(log_dir=str(log_dir)),
    )
    beats = log_dir / "heartbeat"
    beats.mkdir()
    os.environ[HEARTBEAT_ENV] = str(beats)
    exits = ExitWatch(beats, world.devices)  # by local rank, as the error files
    exits.start()
    watchdog = None
    if cfg.hang_timeout_s > 0:
        (beats / WATCHED).touch()  # the workers beat only then
        pids = functools.partial(child_pids, os.getpid())
        watchdog = Watchdog(beats, world.devices, cfg.hang_timeout_s, run_dir, pids)
        watchdog.start()
    entrypoint, args = entry
    if watch is not None:
        watch.start()
    # only a job that can start again gains from it (a restart, an elastic generation)
    restartable = cfg.max_restarts > 0 or elastic(cfg, world)
    preload = Preload(beats) if method == "fork" and cfg.fast_start and restartable else None
    if preload is not None:
        preload.start()
    scrub_every_handler()  # torch's handlers print a failed worker's exception
    try:
        elastic_launch(launch_config, entrypoint)(*args)
    except ChildFailedError as err:
        if watch is not None and watch.fired:
            return watch.fired  # stopped at a step boundary, for the next generation
        codes = {f.exitcode for f in err.failures.values()}
        if EXIT_PREEMPTED in codes and codes <= {EXIT_PREEMPTED, -signal.SIGTERM}:
            raise WorkersPreempted(preempted_message(run_dir)) from None
        if EXIT_TERMINATED in codes and codes <= {EXIT_TERMINATED, -signal.SIGTERM}:
            from framework.worker import Terminated, terminated_message

            raise Terminated(terminated_message(run_dir)) from None  # not restarted
        if watchdog is not None and watchdog.fired:
            return watchdog.fired
        failure = describe_failures(err, log_dir, exits.ended)
        refused(failure)
        return failure
    except Exception as err:
        refused(str(err))
        raise
    finally:
        if watch is not None:
            watch.stop()
        if preload is not None:
            preload.stop()  # before any next start forks: no import is then half done
        del store  # the single-node rendezvous store closes with the job
        if loopback_gloo:
            os.environ.pop(GLOO_IFNAME, None)  # this job's, not the next one's (a sweep's)
        os.environ.pop(HEARTBEAT_ENV, None)
        exits.stop()
        if watchdog is not None:
            watchdog.stop()
        shutil.rmtree(log_dir, ignore_errors=True)
    return None
