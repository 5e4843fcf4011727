"""One start of a `launcher=ray` job: its placement group, one actor per rank, watching them
(failures, signals, the hang watchdog), stopping them."""

from __future__ import annotations

import contextlib
import fnmatch
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from framework.launch.outcomes import WorkersPreempted, preempted_message
from framework.launchers.ray.cluster import bundle, fmt, send_signal
from framework.logs import format_exception
from framework.processes import find_user_modules
from framework.secrets import ENV as SECRETS_ENV
from framework.secrets import process_secrets, redact_text
from framework.watchdog import HEARTBEAT_ENV, STACK_SIGNAL, WATCHED, Watchdog
from framework.world import RESTART_ENV, World

if TYPE_CHECKING:
    from framework.launchers.ray.settings import Config

log = logging.getLogger("framework.launcher")

FORWARDED_SIGNALS = {
    signal.SIGTERM: signal.SIGTERM,
    signal.SIGINT: signal.SIGTERM,  # Ctrl-C reaches fw only: the ranks save, as on SIGTERM
    signal.SIGUSR1: signal.SIGUSR1,
    signal.SIGUSR2: signal.SIGUSR2,
}
FAILURE_GRACE_S = 3.0  # after a rank fails, how long the others get to report their own end


class Rank:
    """What one actor does: tell where it runs, then train as its rank."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def __repr__(self) -> str:  # Ray's prefix of this actor's output lines
        return f"rank {self.rank}"

    def where(self) -> dict:
        import ray

        context = ray.get_runtime_context()
        with socket.socket() as s:  # a port for rank 0's store, free on this node
            s.bind(("", 0))
            port = s.getsockname()[1]
        return {
            "node": context.get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "pid": os.getpid(),
            "gpus": [str(g) for g in context.get_accelerator_ids().get("GPU", [])],
            "port": port,
        }

    def run(self, env: dict, cwd: str, config_path: str, resume_from: str) -> dict:
        """Train as the rank `env` names; {'status': finished|preempted|terminated|failed,
        'error': ...}."""
        os.environ.update(env)
        find_user_modules(cwd)  # the user's modules, as fw finds them
        from framework import worker

        stopped: list = []
        try:
            worker.entry(config_path, resume_from or None, on_preempted=stopped.append)
        except worker.Terminated:  # SIGTERM with no checkpoint taken on it
            return {"status": "terminated"}
        except BaseException as err:  # noqa: BLE001 - SystemExit too: reported as this rank's
            # the task's exception may hold a secret value: Ray shows the rank's output on the
            # console and keeps it in its logs
            sys.stderr.write(format_exception(err))
            error = redact_text(f"{type(err).__name__}: {err}".strip(), process_secrets())
            return {"status": "failed", "error": error}
        return {"status": "preempted" if stopped else "finished"}


class Attempt:
    """One start of every rank: placement group, actors, watching them, stopping them."""

    def __init__(self, cfg: Config, world: World, run_dir: Path, attempt: int) -> None:
        self.cfg, self.world, self.run_dir, self.attempt = cfg, world, run_dir, attempt
        self.actors: list = []
        self.places: list[dict] = []  # where each rank's actor runs (by rank)
        self.signalled: list[int] = []  # signals to pass on, set by the handler
        self.watchdog: JobWatchdog | None = None

    def run(self, config_path: Path, resume_from: Path | None) -> str | None:
        """None when every rank finished, else what failed; raises WorkersPreempted."""
        from ray.util import placement_group, remove_placement_group

        bundles, strategy, _ = placement(self.cfg, self.world)
        group = placement_group(bundles, strategy=strategy)
        beats = self.run_dir / f".fw-heartbeat-{os.getpid()}-{self.attempt}"
        previous = {s: signal.getsignal(s) for s in FORWARDED_SIGNALS}
        try:
            for s in FORWARDED_SIGNALS:
                signal.signal(s, self._on_signal)
            if not group.wait(timeout_seconds=self.cfg.placement_timeout_s):
                return (
                    f"the Ray cluster did not free {len(bundles)} bundles of "
                    f"{fmt(bundles[0])} ({strategy}) within "
                    f"launcher.placement_timeout_s={self.cfg.placement_timeout_s:g}"
                )
            try:
                envs = self.start_actors(group)
            except UnevenNodes as err:
                return str(err)
            self.start_watchdog(beats, envs)
            refs = [
                actor.run.remote(env, os.getcwd(), str(config_path), str(resume_from or ""))
                for actor, env in zip(self.actors, envs, strict=True)
            ]
            return self.watch(refs)
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            if self.watchdog is not None:
                self.watchdog.stop()
            self.stop_actors()
            remove_placement_group(group)
            remove_tree(beats)

    def _on_signal(self, signum: int, frame: Any) -> None:
        if signum == signal.SIGINT and signal.SIGTERM in self.signalled:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now, without saving
        self.signalled.append(FORWARDED_SIGNALS[signal.Signals(signum)])

    def start_actors(self, group) -> list[dict]:
        """One actor per rank in its bundle (`placement`), ranks numbered node by node (rank 0
        on bundle 0's node, local ranks in bundle order); the environment of each rank, in
        rank order."""
        import ray
        from ray.util import placement_group_table
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        on_node = placement_group_table(group)["bundles_to_node_id"]
        _, _, slots = placement(self.cfg, self.world)
        nodes = list(dict.fromkeys(on_node[s] for s in slots))
        order = sorted(range(len(slots)), key=lambda a: (nodes.index(on_node[slots[a]]), a))
        need = bundle(self.cfg, self.world)
        actor_class = ray.remote(Rank)
        self.actors = [
            actor_class.options(
                num_cpus=need["CPU"],
                num_gpus=need.get("GPU", 0),
                max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    group, placement_group_bundle_index=slots[a]
                ),
            ).remote(rank)
            for rank, a in enumerate(order)
        ]
        self.places = ray.get([a.where.remote() for a in self.actors])
        return rank_envs(self.places, nodes, self.cfg, self.world, self.attempt)

    def start_watchdog(self, beats: Path, envs: list[dict]) -> None:
        """Heartbeats in the shared run directory, one folder per node (the workers name their
        files by local rank); one watchdog over every node's folder, which asks every rank for
        its stack."""
        for env in envs:
            folder = beats / env["GROUP_RANK"]
            folder.mkdir(parents=True, exist_ok=True)
            env[HEARTBEAT_ENV] = str(folder)
            if self.cfg.hang_timeout_s > 0:
                (folder / WATCHED).touch()
        if self.cfg.hang_timeout_s > 0:
            self.watchdog = JobWatchdog(
                beats, envs, self.cfg.hang_timeout_s, self.run_dir, self.stacks
            )
            self.watchdog.start()

    def stacks(self) -> list[int]:
        """What a watchdog calls before it copies the stacks: every rank is asked for its stack
        through Ray (the ranks may run on other nodes, so none is returned to kill here: the
        actors are stopped once the watchdog has fired)."""
        if STACK_SIGNAL is not None:
            self.signal_ranks(STACK_SIGNAL)
        return []

    def signal_ranks(self, signum: int) -> None:
        """Send a signal to every rank's process, by a task on its node."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        sent = [
            send_signal.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(p["node"], soft=False)
            ).remote(p["pid"], int(signum))
            for p in self.places
        ]
        ray.wait(sent, num_returns=len(sent), timeout=30)

    def watch(self, refs: list) -> str | None:
        """Wait for every rank; pass signals on; stop the others soon after one fails."""
        import ray

        pending = {ref: rank for rank, ref in enumerate(refs)}
        ended: dict[int, dict] = {}  # rank: outcome, in the order they came
        failed_at = None
        while pending:
            if self.signalled:
                self.signal_ranks(self.signalled.pop(0))
            if self.watchdog is not None and self.watchdog.fired:
                return self.watchdog.fired
            if failed_at is not None and time.monotonic() - failed_at > FAILURE_GRACE_S:
                break  # the others wait in a collective that will not complete
            done, _ = ray.wait(list(pending), num_returns=1, timeout=0.2)
            for ref in done:
                rank = pending.pop(ref)
                ended[rank] = outcome(ref)
                if ended[rank]["status"] == "failed" and failed_at is None:
                    failed_at = time.monotonic()
        statuses = {o["status"] for o in ended.values()}
        if statuses == {"finished"} and not pending:
            return None
        if "preempted" in statuses and statuses <= {"preempted", "finished"} and not pending:
            raise WorkersPreempted(preempted_message(self.run_dir))
        if "terminated" in statuses and statuses <= {"terminated", "finished"} and not pending:
            from framework.worker import Terminated, terminated_message

            raise Terminated(terminated_message(self.run_dir))  # not restarted
        return describe(ended)

    def stop_actors(self) -> None:
        """Kill every actor of this start and wait until Ray reports each one dead."""
        import ray

        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        for actor in self.actors:
            with contextlib.suppress(ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                ray.get(actor.where.remote(), timeout=30)


class JobWatchdog(Watchdog):
    """framework.watchdog's hang watchdog over every node's beat folder: a rank is named by its
    global rank, and the stacks of the ranks on every node are gathered."""

    def __init__(self, beats: Path, envs: list[dict], timeout: float, run_dir: Path, stacks):
        super().__init__(beats, len(envs), timeout, run_dir, stacks)
        self.beat_files = [beats / e["GROUP_RANK"] / f"rank{e['LOCAL_RANK']}" for e in envs]
        self.folders = sorted({path.parent for path in self.beat_files})

    def _beat(self, rank: int) -> float | None:
        try:
            return self.beat_files[rank].stat().st_mtime
        except FileNotFoundError:
            return None

    def _busy(self) -> bool:
        return any(any(folder.glob("busy-rank*")) for folder in self.folders)

    def _stack_files(self) -> list[Path]:
        return sorted(p for folder in self.folders for p in folder.glob("stacks-rank*.txt"))


def outcome(ref) -> dict:
    """A rank's result, or how its actor ended."""
    import ray

    try:
        return ray.get(ref)
    except ray.exceptions.RayActorError as err:
        lines = [line for line in str(err).splitlines() if line.strip()]
        reason = next((line for line in lines if "died" in line or "exit" in line), lines[0])
        return {"status": "failed", "error": f"its actor died ({reason.strip()})", "died": True}
    except ray.exceptions.RayError as err:
        return {"status": "failed", "error": str(err).splitlines()[0]}


def describe(ended: dict[int, dict]) -> str:
    """'rank N failed: ...' for every failed rank: a rank whose process died first (the others
    then fail in their next collective), then in the order their failures arrived."""
    failed = [(rank, o) for rank, o in ended.items() if o["status"] == "failed"]
    failed.sort(key=lambda item: not item[1].get("died"))
    if not failed:
        return "the ranks were stopped before they finished"
    return "\n".join(f"rank {rank} failed: {o['error']}" for rank, o in failed)


def placement(cfg: Config, world: World) -> tuple[list[dict], str, list[int]]:
    """The job's bundles, how Ray places them, and the bundle of each rank (by start order).
    On the CPU one bundle per rank, placed by launcher.strategy. On CUDA one bundle of
    trainer.devices GPUs per node, each on a node of its own (STRICT_SPREAD): Lightning asks
    every node for trainer.devices GPUs, and a node given fewer ranks (PACK on a partly busy
    cluster, SPREAD over more nodes than trainer.num_nodes) would see fewer; one given more
    would number local ranks past its devices."""
    one = bundle(cfg, world)
    if not world.is_cuda:
        return [one] * world.world_size, cfg.strategy, list(range(world.world_size))
    node = {resource: amount * world.devices for resource, amount in one.items()}
    ranks = [rank // world.devices for rank in range(world.world_size)]
    return [node] * world.num_nodes, "STRICT_SPREAD", ranks


class UnevenNodes(RuntimeError):
    """A CUDA job's ranks were placed with other than trainer.devices on some node."""


def rank_envs(places: list[dict], nodes: list[str], cfg: Config, world: World, attempt: int):
    """The environment of each rank, as torch's elastic launch gives a local worker. On CUDA
    every node must hold trainer.devices ranks (UnevenNodes otherwise, before any rank runs)."""
    if world.is_cuda:
        counts = {node: sum(p["node"] == node for p in places) for node in nodes}
        uneven = {node: n for node, n in counts.items() if n != world.devices}
        if uneven:
            shown = ", ".join(f"{n} on node {node[:8]}" for node, n in uneven.items())
            raise UnevenNodes(
                f"the Ray cluster placed {shown}: on CUDA every node must hold "
                f"trainer.devices={world.devices} ranks (Lightning asks each node for that "
                "many GPUs)"
            )
    forwarded = {
        name: value
        for name, value in os.environ.items()
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in cfg.forward_env)
    }
    if SECRETS_ENV in os.environ:  # config.yaml holds them as '***'
        forwarded[SECRETS_ENV] = os.environ[SECRETS_ENV]
    forwarded.setdefault("OMP_NUM_THREADS", str(cfg.cpus_per_rank))
    first = places[0]
    envs = []
    for rank, place in enumerate(places):
        same = [p for p in places if p["node"] == place["node"]]
        env = {
            **forwarded,
            "RANK": str(rank),
            "LOCAL_RANK": str(same.index(place)),
            "WORLD_SIZE": str(world.world_size),
            "LOCAL_WORLD_SIZE": str(len(same)),
            "GROUP_RANK": str(nodes.index(place["node"])),
            "GROUP_WORLD_SIZE": str(len(nodes)),
            "ROLE_RANK": str(rank),
            "ROLE_WORLD_SIZE": str(world.world_size),
            "ROLE_NAME": "default",
            "MASTER_ADDR": first["ip"],
            "MASTER_PORT": str(first["port"]),
            "TORCHELASTIC_RUN_ID": f"ray-{os.getpid()}",
            "TORCHELASTIC_USE_AGENT_STORE": "False",
            "TORCHELASTIC_MAX_RESTARTS": str(cfg.max_restarts),
            RESTART_ENV: str(attempt),
        }
        # on CUDA the node's GPUs of this job by local rank (LOCAL_RANK is its own); else none,
        # so a rank with trainer.accelerator=auto trains on the CPU as planned here, not on GPUs
        # of its node that no bundle reserved
        env["CUDA_VISIBLE_DEVICES"] = ",".join(g for p in same for g in p["gpus"])
        envs.append(env)
    return envs


def remove_tree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)
