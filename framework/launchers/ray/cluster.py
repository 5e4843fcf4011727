"""`launcher=ray` before anything is written: reaching the cluster, its resources, whether
every node sees the run directory; and the small tasks the launcher runs on its nodes."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from framework.errors import ConfigError
from framework.processes import init_ray, python
from framework.world import World

if TYPE_CHECKING:
    from framework.launchers.ray.settings import Config


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
    """None when the GCS at `address` tells its cluster id within `timeout_s`, else why not.
    Asked from a child process, killed at the deadline: Ray's client retries a silent server for
    much longer, and a client thread left inside Ray's native code when `fw` exits can crash
    the interpreter's shutdown (exit -11 after the refusal was printed)."""
    try:
        done = subprocess.run(
            python("-c", _ASK_GCS, address),  # no module from the working directory
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        return "no answer"
    if done.returncode == 0:
        return None
    return done.stdout.strip() or f"the probe exited with {done.returncode}"


_ASK_GCS = """
import sys
from ray._raylet import GcsClient
try:
    GcsClient(address=sys.argv[1])
except Exception as err:  # any failure means: not a cluster we can join
    print((str(err).splitlines() or [type(err).__name__])[0][:200] or type(err).__name__)
    sys.exit(1)
"""


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
        init_ray(address, **options)
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
        hint="Ask for fewer ranks, launcher.cpus_per_rank, or another launcher.strategy."
        + (
            " The cluster has no GPU: trainer.accelerator=cpu, or a cluster with GPUs."
            if "GPU" in need and not any(n["Resources"].get("GPU") for n in nodes)
            else ""
        ),
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
