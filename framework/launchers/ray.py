"""`launcher=ray`: the job's ranks as Ray actors on a Ray cluster (KubeRay, Anyscale, `ray start`).

`fw` composes and checks the config once, as always; validation also reaches the cluster
(`launcher.address`, else RAY_ADDRESS, else a new cluster on this machine): its head's port must
answer within `probe_timeout_s` (Ray alone retries a silent address for minutes), and the
cluster must hold `trainer.num_nodes x trainer.devices` bundles (one per rank: `cpus_per_rank`
CPUs, and a GPU on CUDA). On a cluster of several nodes, `run.dir` must be seen by every node:
a probe file written next to it must be read back on each node, else the job is refused.

The bundles are reserved in one placement group (`launcher.strategy`), one actor per bundle.
Each actor runs the ordinary worker entry with the environment a local worker gets from
torch's elastic launch (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT of rank 0's node, ...);
ranks are numbered node by node, so local ranks are contiguous. Their output reaches this
console through Ray, each line prefixed with its rank. When an actor fails (or its node is
lost) the others are stopped and, while `max_restarts` allows, every rank starts again from the
newest complete checkpoint. SIGTERM/SIGINT/SIGUSR1 to `fw` reach every rank (as SIGTERM for
SIGINT): they save at the next step and `fw` exits 75; no actor outlives `fw`. The hang watchdog
of launcher=local (framework.watchdog) watches the ranks' beats in the shared run directory.
"""

from __future__ import annotations

import contextlib
import fnmatch
import logging
import os
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from framework import checkpointing
from framework.config.fields import doc
from framework.errors import ConfigError
from framework.launchers.local import (
    WorkerFailure,
    WorkersPreempted,
    preempted_message,
    record_restart,
)
from framework.secrets import ENV as SECRETS_ENV
from framework.watchdog import HEARTBEAT_ENV, STACK_SIGNAL, WATCHED, Watchdog
from framework.world import RESTART_ENV, World

if TYPE_CHECKING:
    from framework.config.job_plan import JobPlan

log = logging.getLogger("framework.launcher")

__all__ = ["Config", "build", "join", "validate"]

STRATEGIES = ("PACK", "SPREAD", "STRICT_SPREAD")
FORWARDED = [
    "FW_*",
    "WANDB_*",
    "HF_*",
    "TRANSFORMERS_*",
    "TORCH_*",
    "NCCL_*",
    "DS_*",
    "OMP_NUM_THREADS",
    "PYTHONPATH",
]
FORWARDED_SIGNALS = {
    signal.SIGTERM: signal.SIGTERM,
    signal.SIGINT: signal.SIGTERM,  # Ctrl-C reaches fw only: the ranks save, as on SIGTERM
    signal.SIGUSR1: signal.SIGUSR1,
    signal.SIGUSR2: signal.SIGUSR2,
}
FAILURE_GRACE_S = 3.0  # after a rank fails, how long the others get to report their own end


@dataclass
class Config:
    """Run every rank as an actor on a Ray cluster, in one placement group."""

    kind: str = doc("ray", "Launcher plugin.")
    address: str = doc(
        "",
        "The Ray cluster: its head's HOST:PORT (the GCS port, 6379 by default), `auto` (the "
        "cluster this machine belongs to) or `local` (a new cluster on this machine, stopped "
        "when the job ends); empty: RAY_ADDRESS, else `local`.",
    )
    strategy: str = doc(
        "PACK",
        "How the ranks' bundles are placed on nodes (Ray's placement strategies): PACK as few "
        "nodes as possible, SPREAD over as many as possible, STRICT_SPREAD one node per rank.",
        STRATEGIES,
    )
    cpus_per_rank: int = doc(1, "CPUs reserved for each rank (and its CPU threads).", min=1)
    max_restarts: int = doc(
        0,
        "When a rank fails, its node is lost or the job hangs, stop every actor and start them "
        "again from the newest complete checkpoint, up to this many times.",
        min=0,
    )
    hang_timeout_s: float = doc(
        300.0,
        "End (or restart) the job when a rank makes no training progress for this many seconds, "
        "after saving every rank's Python stack in RUN_DIR/stacks (0: no watchdog).",
        min=0,
    )
    probe_timeout_s: float = doc(
        10.0,
        "How long the cluster's address may take to answer before the job is refused.",
        above=0,
    )
    placement_timeout_s: float = doc(
        600.0, "How long to wait for the cluster to free the job's bundles.", above=0
    )
    forward_env: list = doc(
        FORWARDED,
        "Environment variables of the fw process every rank gets (names; * matches any text); "
        "the rest of a rank's environment is its node's.",
    )


def validate(cfg: Config, world: World) -> None:
    """The address answers, Ray connects, and the cluster can hold every rank's bundle."""
    address, key = cluster_address(cfg)
    if address not in ("local", "auto"):
        probe(address, key, cfg.probe_timeout_s)
    connect(address, key, world, cfg)
    check_resources(cfg, world)


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
            for attempt in range(cfg.max_restarts + 1):
                if attempt:  # from the newest checkpoint this job completed, else where it began
                    newest = checkpointing.newest_complete(run_dir / "checkpoints")
                    resume_from = newest or resume_from
                failure = Attempt(cfg, world, run_dir, attempt).run(config_path, resume_from)
                if failure is None:
                    return
                if attempt == cfg.max_restarts:
                    after = f" (after {attempt} restart{'s' * (attempt > 1)})" if attempt else ""
                    raise WorkerFailure(failure + after)
                log.warning("Restart %d of %d after: %s", attempt + 1, cfg.max_restarts, failure)
                record_restart(run_dir, attempt + 1, failure)
        finally:
            ray.shutdown()  # a cluster started here stops with it

    return launch


# --- the cluster, before anything is written ---------------------------------------------------


def cluster_address(cfg: Config) -> tuple[str, str]:
    """The address to connect to and the setting it came from."""
    if cfg.address:
        return cfg.address, "launcher.address"
    if os.environ.get("RAY_ADDRESS"):
        return os.environ["RAY_ADDRESS"], "RAY_ADDRESS"
    return "local", "launcher.address"


def probe(address: str, key: str, timeout_s: float) -> None:
    """ConfigError unless Ray's head (its GCS) answers at HOST:PORT within `timeout_s`, where
    Ray itself would retry for minutes. A port that accepts connections is not enough: a
    firewall or a proxy may; the GCS must answer a request for the cluster's id."""
    host, colon, port = address.removeprefix("ray://").rpartition(":")
    if not colon or not port.isdigit():
        raise ConfigError(key, address, "not a Ray address", ["HOST:PORT", "auto", "local"])
    deadline = time.monotonic() + timeout_s
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
        answer = None
        if not address.startswith("ray://"):  # Ray Client's server is not the GCS
            answer = ask_gcs(f"{host}:{port}", max(deadline - time.monotonic(), 0.001))
    except OSError as err:
        answer = str(err)
    if answer is None:
        return
    auth = "token" in answer.lower() or "authenticat" in answer.lower()
    raise ConfigError(
        key,
        address,
        f"no Ray cluster answers there within launcher.probe_timeout_s={timeout_s:g} ({answer})",
        hint="Set RAY_AUTH_MODE=token and give this machine the cluster's token "
        "(~/.ray/auth_token or RAY_AUTH_TOKEN)."
        if auth
        else "Give the head node's HOST:PORT (`ray start --head` prints it; 6379 by default), "
        "or launcher.address=local for a cluster on this machine.",
    ) from None


def ask_gcs(address: str, timeout_s: float) -> str | None:
    """None when the GCS at `address` tells its cluster id within `timeout_s`, else why not
    (asked from a thread: Ray's client retries a silent server for much longer)."""
    from ray._raylet import GcsClient

    answers: list[str | None] = []

    def ask() -> None:
        try:
            GcsClient(address=address)
            answers.append(None)
        except Exception as err:  # noqa: BLE001 - any failure means: not a cluster we can join
            answers.append(str(err).splitlines()[0][:200] or type(err).__name__)

    thread = threading.Thread(target=ask, name="fw-ray-probe", daemon=True)
    thread.start()
    thread.join(timeout_s)
    return answers[0] if answers else "no answer"


def connect(address: str, key: str, world: World, cfg: Config) -> None:
    """Connect this process to the cluster (once), ranks' output streamed to this console."""
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")  # every rank's lines, not the first one's
    import ray

    if ray.is_initialized():
        return
    options: dict[str, Any] = {"logging_level": logging.WARNING, "log_to_driver": True}
    if address == "local":
        cpus = max(os.cpu_count() or 1, world.world_size * cfg.cpus_per_rank)
        options.update(num_cpus=cpus, include_dashboard=False)
    try:
        ray.init(address=address, **options)
    except (ConnectionError, RuntimeError, ray.exceptions.AuthenticationError) as err:
        raise ConfigError(
            key,
            address,
            f"no Ray cluster could be joined there ({str(err).splitlines()[0]})",
            hint="With token authentication (the default of `ray start`), set RAY_AUTH_MODE=token "
            "and give this machine the cluster's token (~/.ray/auth_token or RAY_AUTH_TOKEN).",
        ) from None


def bundle(cfg: Config, world: World) -> dict[str, float]:
    """What one rank reserves."""
    return {"CPU": float(cfg.cpus_per_rank), **({"GPU": 1.0} if world.is_cuda else {})}


def check_resources(cfg: Config, world: World) -> None:
    """ConfigError, showing the cluster's resources, when it cannot hold the job's bundles."""
    import ray

    need = bundle(cfg, world)
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    fits = [min(n["Resources"].get(r, 0.0) // v for r, v in need.items()) for n in nodes]
    room = sum(fits) if cfg.strategy != "STRICT_SPREAD" else sum(1 for f in fits if f >= 1)
    if room >= world.world_size:
        return
    shown = "; ".join(
        f"node {n['NodeManagerAddress']} ({n['NodeID'][:8]}): "
        + ", ".join(f"{r}={n['Resources'].get(r, 0.0):g}" for r in need)
        for n in nodes
    )
    raise ConfigError(
        "trainer.devices",
        world.devices,
        f"{world.world_size} ranks (trainer.num_nodes={world.num_nodes} x trainer.devices="
        f"{world.devices}) need {world.world_size} bundles of {fmt(need)} placed "
        f"{cfg.strategy}, but the Ray cluster holds {room:g}: {shown or 'no live node'}",
        hint="Ask for fewer ranks, launcher.cpus_per_rank, or another launcher.strategy.",
    )


def fmt(resources: dict[str, float]) -> str:
    return "{" + ", ".join(f"{r}: {v:g}" for r, v in resources.items()) + "}"


def check_shared(run_dir: Path, timeout_s: float) -> None:
    """On a cluster of several nodes, every node reads back a probe file written next to the run
    directory; ConfigError naming the first node that does not (nothing is left behind)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    if len(nodes) < 2:
        return
    where = run_dir
    while not where.exists():
        where = where.parent
    token = os.urandom(8).hex()
    probe_dir = Path(tempfile.mkdtemp(prefix=".fw-shared-probe-", dir=where))
    try:
        (probe_dir / "token").write_text(token)
        reads = [
            read_text.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)
            ).remote(str(probe_dir / "token"))
            for n in nodes
        ]
        ready, _ = ray.wait(reads, num_returns=len(reads), timeout=max(timeout_s, 30.0))
        seen = [ray.get(r) if r in ready else None for r in reads]
    finally:
        (probe_dir / "token").unlink(missing_ok=True)
        probe_dir.rmdir()
    for node, text in zip(nodes, seen, strict=True):
        if text != token:
            raise ConfigError(
                "run.dir",
                str(run_dir),
                f"the Ray cluster has {len(nodes)} nodes and node {node['NodeManagerAddress']} "
                f"({node['NodeID'][:8]}) does not see {where} (a file written there was not "
                "there for it): every rank writes checkpoints and logs into run.dir",
                hint="Put run.dir on storage every node mounts at the same path (NFS, a "
                "Kubernetes ReadWriteMany volume).",
            )


def _read_text(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None


def _send_signal(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signum)


def _remote(fn):
    """A zero-CPU Ray task of `fn`, made on first use (importing ray stays lazy)."""
    made = {}

    class Lazy:
        def options(self, **kwargs):
            if "task" not in made:
                import ray

                made["task"] = ray.remote(num_cpus=0, max_retries=0)(fn)
            return made["task"].options(**kwargs)

    return Lazy()


read_text = _remote(_read_text)
send_signal = _remote(_send_signal)


# --- one start of the job's ranks --------------------------------------------------------------


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
        """Train as the rank `env` names; {'status': finished|preempted|failed, 'error': ...}."""
        os.environ.update(env)
        if os.path.isdir(cwd):  # the user's modules, as fw finds them
            os.chdir(cwd)
            if cwd not in sys.path:
                sys.path.append(cwd)
        from framework import worker

        stopped: list = []
        try:
            worker.entry(config_path, resume_from or None, on_preempted=stopped.append)
        except BaseException as err:  # noqa: BLE001 - SystemExit too: reported as this rank's
            traceback.print_exc()
            return {"status": "failed", "error": f"{type(err).__name__}: {err}".strip()}
        return {"status": "preempted" if stopped else "finished"}


class Attempt:
    """One start of every rank: placement group, actors, watching them, stopping them."""

    def __init__(self, cfg: Config, world: World, run_dir: Path, attempt: int) -> None:
        self.cfg, self.world, self.run_dir, self.attempt = cfg, world, run_dir, attempt
        self.actors: list = []
        self.places: list[dict] = []  # where each rank's actor runs (by rank)
        self.signalled: list[int] = []  # signals to pass on, set by the handler
        self.watchdogs: list[Watchdog] = []

    def run(self, config_path: Path, resume_from: Path | None) -> str | None:
        """None when every rank finished, else what failed; raises WorkersPreempted."""
        from ray.util import placement_group, remove_placement_group

        group = placement_group(
            [bundle(self.cfg, self.world)] * self.world.world_size, strategy=self.cfg.strategy
        )
        beats = self.run_dir / f".fw-heartbeat-{os.getpid()}-{self.attempt}"
        previous = {s: signal.getsignal(s) for s in FORWARDED_SIGNALS}
        try:
            for s in FORWARDED_SIGNALS:
                signal.signal(s, self._on_signal)
            if not group.wait(timeout_seconds=self.cfg.placement_timeout_s):
                return (
                    f"the Ray cluster did not free {self.world.world_size} bundles of "
                    f"{fmt(bundle(self.cfg, self.world))} within "
                    f"launcher.placement_timeout_s={self.cfg.placement_timeout_s:g}"
                )
            envs = self.start_actors(group)
            self.start_watchdogs(beats, envs)
            refs = [
                actor.run.remote(env, os.getcwd(), str(config_path), str(resume_from or ""))
                for actor, env in zip(self.actors, envs, strict=True)
            ]
            return self.watch(refs)
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            for dog in self.watchdogs:
                dog.stop()
            self.stop_actors()
            remove_placement_group(group)
            remove_tree(beats)

    def _on_signal(self, signum: int, frame: Any) -> None:
        if signum == signal.SIGINT and signal.SIGTERM in self.signalled:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now, without saving
        self.signalled.append(FORWARDED_SIGNALS[signal.Signals(signum)])

    def start_actors(self, group) -> list[dict]:
        """One actor per bundle, ranks numbered node by node (rank 0 on bundle 0's node, local
        ranks in bundle order); the environment of each rank, in rank order."""
        import ray
        from ray.util import placement_group_table
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        on_node = placement_group_table(group)["bundles_to_node_id"]
        nodes = list(dict.fromkeys(on_node[i] for i in range(self.world.world_size)))
        bundles = sorted(range(self.world.world_size), key=lambda i: (nodes.index(on_node[i]), i))
        need = bundle(self.cfg, self.world)
        actor_class = ray.remote(Rank)
        self.actors = [
            actor_class.options(
                num_cpus=need["CPU"],
                num_gpus=need.get("GPU", 0),
                max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    group, placement_group_bundle_index=index
                ),
            ).remote(rank)
            for rank, index in enumerate(bundles)
        ]
        self.places = ray.get([a.where.remote() for a in self.actors])
        return rank_envs(self.places, nodes, self.cfg, self.world, self.attempt)

    def start_watchdogs(self, beats: Path, envs: list[dict]) -> None:
        """Heartbeats in the shared run directory, one folder per node (by local rank, as the
        workers write them); one watchdog each, which asks every rank for its stack."""
        for node in sorted({int(env["GROUP_RANK"]) for env in envs}):
            folder = beats / str(node)
            folder.mkdir(parents=True)
            for env in envs:
                if int(env["GROUP_RANK"]) == node:
                    env[HEARTBEAT_ENV] = str(folder)
            if self.cfg.hang_timeout_s > 0:
                (folder / WATCHED).touch()
                ranks = sum(int(e["GROUP_RANK"]) == node for e in envs)
                dog = Watchdog(folder, ranks, self.cfg.hang_timeout_s, self.run_dir, self.stacks)
                dog.start()
                self.watchdogs.append(dog)

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
            fired = next((d.fired for d in self.watchdogs if d.fired), None)
            if fired:
                return fired
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
        return describe(ended)

    def stop_actors(self) -> None:
        """Kill every actor of this start and wait until Ray reports each one dead."""
        import ray

        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        for actor in self.actors:
            with contextlib.suppress(ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                ray.get(actor.where.remote(), timeout=30)


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


def rank_envs(places: list[dict], nodes: list[str], cfg: Config, world: World, attempt: int):
    """The environment of each rank, as torch's elastic launch gives a local worker."""
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
        if world.is_cuda:  # the node's GPUs of this job by local rank: LOCAL_RANK is its own
            env["CUDA_VISIBLE_DEVICES"] = ",".join(g for p in same for g in p["gpus"])
        envs.append(env)
    return envs


def remove_tree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)
