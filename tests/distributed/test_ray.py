"""`launcher=ray` on a real Ray cluster on this machine: a head (`ray start --head`, 4 CPUs) and
a second raylet joined to it (2 CPUs and one GPU, declared: the machine has none), two nodes of
one cluster. The second runs in its own mount namespace where one directory is a private tmpfs:
a run directory there is not shared.

The ranks as Ray actors train bitwise as the local launcher's processes (gpt under fsdp, one rank
on each node; digits under ddp, in the kill test, where every step equals the local launcher's),
with one W&B run per job; a rank killed with kill -9 is restarted from the newest checkpoint and
the job ends as an uninterrupted one; a hung rank is caught by the watchdog; SIGTERM to `fw`
saves, exits 75 and leaves no actor alive; bad input is refused with exit 2 before anything is
written, devices counted on the cluster. The fixture stops only the processes of its own
cluster (`ray stop` would stop every Ray cluster on the machine)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import ray  # noqa: F401 (the ray extra: missing, these fail, not skip)

from tests.conftest import FW, QUIET, fw_env, metric_rows
from tests.distributed.test_resume import wait_for_step

pytestmark = pytest.mark.slow
RAY = Path(sys.executable).parent / "ray"
STEPS = 20
SLOW = [
    "task._target_=tests.tasks.SlowDigitsTask",
    "task.model.hidden=64",
    "task.model.dropout=0.1",
    "+task.model.step_sleep=0.1",
    "task.data.batch_size=32",
    "trainer.devices=2",
    f"trainer.max_steps={STEPS}",
    "trainer.log_every_n_steps=1",
    "trainer.deterministic=true",
    "callbacks.checkpoint.every_n_steps=5",
    *QUIET,
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cluster_pids(temp: str) -> set[int]:
    """The processes of the cluster whose temp dir is `temp` (their command lines name it) and
    their descendants (Ray's workers and agents)."""
    parents, found = {}, set()
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmdline = (proc / "cmdline").read_bytes()
            parents[int(proc.name)] = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if temp.encode() in cmdline:
            found.add(int(proc.name))
    grown = True
    while grown:
        children = {pid for pid, parent in parents.items() if parent in found} - found
        grown = bool(children)
        found |= children
    return found - {os.getpid()}


def stop_cluster(temp: str) -> None:
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 2.0)):
        pids = cluster_pids(temp)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while cluster_pids(temp) and time.monotonic() < deadline:
            time.sleep(0.1)


def ray_env() -> dict[str, str]:
    # token authentication is what `ray start` turns on; two fw ranks share 2 cores: one
    # thread each, in the local reference too
    return {**fw_env(), "RAY_AUTH_MODE": "token", "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def cluster():
    """A Ray cluster of two raylets on this machine; its address, and a directory the second
    node does not share (None where a private mount cannot be made)."""
    temp = tempfile.mkdtemp(prefix="fwray", dir="/tmp")  # short: Ray's socket paths are limited
    port = free_port()
    address = f"127.0.0.1:{port}"
    common = [
        "--disable-usage-stats",
        "--node-ip-address=127.0.0.1",
        "--object-store-memory=80000000",
    ]
    head = [str(RAY), "start", "--head", f"--port={port}", "--num-cpus=4", f"--temp-dir={temp}"]
    head += [f"--dashboard-port={free_port()}", *common]
    private = Path(temp) / "private"
    private.mkdir()
    # a GPU as a Ray resource only: what the cluster holds is counted, not what this machine has
    second = [str(RAY), "start", f"--address={address}", "--num-cpus=2", "--num-gpus=1", *common]
    try:
        started = subprocess.run(head, env=ray_env(), capture_output=True, text=True, timeout=120)
        assert started.returncode == 0, started.stderr[-3000:]
        unshared = shutil.which("unshare") and os.geteuid() == 0
        if unshared:  # the second node gets its own empty tmpfs at `private`
            script = f"mount -t tmpfs fwray {private} && exec {' '.join(second)}"
            second = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script]
        # Ray refuses a GPU that CUDA_VISIBLE_DEVICES hides; the ranks get their own list
        gpu = {**ray_env(), "CUDA_VISIBLE_DEVICES": "0"}
        joined = subprocess.run(second, env=gpu, capture_output=True, text=True, timeout=120)
        assert joined.returncode == 0, joined.stderr[-3000:]
        yield {"address": address, "temp": temp, "private": private if unshared else None}
    finally:
        stop_cluster(temp)
        shutil.rmtree(temp, ignore_errors=True)


def start(args: list[str], cwd: Path, address: str) -> subprocess.Popen:
    return subprocess.Popen(
        [str(FW), "train", *args],
        cwd=cwd,
        env={**ray_env(), "RAY_ADDRESS": address},
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def train(args: list[str], cwd: Path, address: str, timeout: float = 300):
    proc = start(args, cwd, address)
    try:
        err = proc.communicate(timeout=timeout)[1]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, err


def alive_actors(address: str) -> list[int]:
    """The pids of the cluster's live actors, from its GCS, in a process of its own.
    (`ray.util.state` asks the dashboard's HTTP server, which the `ray` extra does not install:
    its head runs in minimal mode; the GCS's actor table is what that server reads.)"""
    script = (
        "import json, ray; "
        f"ray.init(address={address!r}, logging_level='ERROR', log_to_driver=False); "
        "table = ray._private.state.actors().values(); "
        "print(json.dumps([a['Pid'] for a in table if a['State'] == 'ALIVE']))"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], env=ray_env(), capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cluster) -> Path:
    """The same job by the local launcher: two processes on this machine."""
    run = tmp_path_factory.mktemp("local") / "run"
    code, err = train([*SLOW, f"run.dir={run}"], run.parent, cluster["address"])
    assert code == 0, err[-3000:]
    return run


def wandb_runs(run: Path) -> list[str]:
    """The offline W&B run directories of a run directory; each must be of the job's run id."""
    run_id = json.loads((run / "run.json").read_text())["run_id"]
    found = sorted(p.name for p in (run / "wandb").glob("offline-run-*"))
    assert all(name.endswith(f"-{run_id}") for name in found), (found, run_id)
    return found


def test_gpt_under_fsdp_on_two_nodes_trains_bitwise_as_the_local_launcher(cluster, workdir):
    """One rank on each node (the second in its own mount namespace) against two local
    processes; one W&B run for the job, of the run id in run.json."""
    gpt = ["experiment=gpt_tiny", "strategy=fsdp", "trainer.max_steps=6", "callbacks=none"]
    gpt += ["trainer.log_every_n_steps=1", "trainer.deterministic=true", *QUIET]
    on_ray = ["launcher=ray", "launcher.strategy=STRICT_SPREAD", "logger.wandb.mode=offline"]
    runs = {
        "local": ["trainer.devices=2"],
        "ray": [*on_ray, "trainer.devices=1", "trainer.num_nodes=2"],
    }
    for name, layout in runs.items():
        code, err = train([*gpt, *layout, f"run.dir={name}"], workdir, cluster["address"])
        assert code == 0, err[-3000:]
    assert metric_rows(workdir / "ray") == metric_rows(workdir / "local"), "bitwise local's"
    assert len(metric_rows(workdir / "ray")) == 6
    assert "(rank 1 pid=" in err, "each rank's output reaches the console, prefixed"
    assert len(wandb_runs(workdir / "ray")) == 1, "one W&B run for the job, none per rank"


def rank_pids(temp: str) -> list[int]:
    """The processes of the cluster's actors of launcher=ray (Ray titles them ray::Rank...)."""
    found = []
    for pid in cluster_pids(temp):
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"ray::Rank"):
                found.append(pid)
    return sorted(found)


def test_a_killed_rank_is_restarted_from_the_newest_checkpoint(cluster, reference, workdir):
    run = workdir / "run"
    slower = [a.replace("step_sleep=0.1", "step_sleep=0.3") for a in SLOW]  # same losses
    args = [*slower, "launcher=ray", "launcher.max_restarts=1", f"run.dir={run}"]
    args.append("logger.wandb.mode=offline")
    proc = start(args, workdir, cluster["address"])
    try:
        wait_for_step(run, 7, proc, timeout=300)  # a fresh interpreter per rank: slow under load
        ranks = rank_pids(cluster["temp"])
        assert len(ranks) == 2, ranks
        os.kill(ranks[1], signal.SIGKILL)
        err = proc.communicate(timeout=300)[1]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, err[-3000:]
    killed = re.search(rf"\(rank (\d) pid={ranks[1]}\)", err)
    assert killed, err[-3000:]
    assert f"Restart 1 of 1 after: rank {killed[1]} failed: its actor died" in err, err[-3000:]
    assert "(restart 1)" in err, "the restarted ranks resumed from a checkpoint"
    rows = metric_rows(run)
    assert [s for s, _ in rows] == list(range(STEPS)), "each step exactly once"
    assert rows == metric_rows(reference), "losses after the restart are bitwise uninterrupted ones"
    assert len(wandb_runs(run)) == 2, "one W&B run directory per start, all of one run id"


def test_sigterm_saves_exits_75_and_leaves_no_actor(cluster, workdir):
    run = workdir / "run"
    proc = start([*SLOW, "launcher=ray", f"run.dir={run}"], workdir, cluster["address"])
    try:
        wait_for_step(run, 3, proc, timeout=300)
        os.kill(proc.pid, signal.SIGTERM)
        err = proc.communicate(timeout=120)[1]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 75, err[-3000:]
    stopped = int(err.split("checkpoint saved at step ")[1].split(";")[0])
    assert 4 <= stopped < STEPS, err[-3000:]
    assert (run / "checkpoints" / f"step{stopped:08d}" / "meta.json").is_file()
    assert alive_actors(cluster["address"]) == [], "no actor outlives fw"


def test_a_failed_rank_without_restarts_ends_the_job_naming_it(cluster, workdir):
    args = ["task._target_=tests.tasks.FailingDigitsTask", "~task.model.dropout"]
    args += ["trainer.devices=2", "trainer.max_steps=50", "trainer.log_every_n_steps=1", *QUIET]
    code, err = train([*args, "launcher=ray", "run.dir=run"], workdir, cluster["address"])
    ended = time.time()
    assert code == 1, err[-3000:]
    assert "rank 1 failed: RuntimeError: deliberate failure at step 3" in err, err[-3000:]
    # rank 0 wrote step 2's row just before rank 1 raised in step 3; rank 0 then waits in a
    # collective that never completes (gloo's timeout: 30 min) until the launcher stops it
    assert ended - (workdir / "run" / "metrics.csv").stat().st_mtime < 30


def test_a_hung_rank_is_caught_by_the_watchdog_leaving_no_actor(cluster, workdir):
    """Rank 1, on the second node, blocks in step 3 and rank 0 waits in a collective: the
    watchdog reads both nodes' beats in the run directory, gathers both ranks' stacks through
    Ray, and the job ends with exit 1 soon after the hang timeout, every actor stopped."""
    timeout = 4
    args = ["task._target_=tests.tasks.HangingDigitsTask", f"+task.model.out={workdir}"]
    args += ["~task.model.dropout", "task.model.hidden=16", "trainer.max_steps=50", *QUIET]
    args += ["trainer.devices=1", "trainer.num_nodes=2", f"launcher.hang_timeout_s={timeout}"]
    args += ["launcher=ray", "launcher.strategy=STRICT_SPREAD", "run.dir=run"]
    code, err = train(args, workdir, cluster["address"])
    ended = time.time()
    assert code == 1, err[-3000:]
    hung = f"the job hung: no training progress within launcher.hang_timeout_s={timeout} (rank 0:"
    assert hung in err and ", rank 1: " in err, err[-3000:]
    # the message proves the watchdog ended the job; the bound rules out gloo's 30 min timeout
    assert ended - float((workdir / "hung").read_text()) < timeout + 30
    stacks = sorted((workdir / "run" / "stacks").glob("*/rank*.txt"))
    assert [p.name for p in stacks] == ["rank0.txt", "rank1.txt"], err[-3000:]
    assert "training_step" in stacks[1].read_text(), "the hung rank's stack shows where it is"
    assert "distributed_c10d.py" in stacks[0].read_text(), "the other rank waits in a collective"
    assert alive_actors(cluster["address"]) == [], "no actor outlives fw"


def refused(args: list[str], cwd: Path, address: str, run: Path | None = None):
    """fw train's stderr and how long it took; it exits 2 having written nothing."""
    run = run or cwd / "run"
    began = time.monotonic()
    code, err = train(["task=digits", "launcher=ray", f"run.dir={run}", *args], cwd, address, 120)
    assert code == 2 and "Traceback" not in err, err[-3000:]
    assert not run.exists(), "nothing written"
    return err, time.monotonic() - began


def test_a_silent_address_is_refused_within_the_probe_timeout(workdir):
    """A port that accepts connections and never answers (a firewall, a proxy, a hung head):
    Ray itself would retry it for minutes."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # the kernel accepts; nobody answers
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        err, took = refused(["launcher.probe_timeout_s=3"], workdir, address)
    assert f"RAY_ADDRESS={address}: no Ray cluster answers there within" in err, err[-3000:]
    assert took < 60, "refused in seconds (the probe's 3 s and fw's start), not minutes"


def test_more_bundles_than_the_cluster_holds_are_refused_with_its_resources(cluster, workdir):
    """A CUDA job from this machine, which has no GPU, is held to the cluster's resources, CPUs
    and GPUs: 2 ranks of {CPU: 3, GPU: 1} fit on no node (4 CPUs and no GPU; 2 CPUs and a GPU).
    Counting only one of them, the cluster would hold 1."""
    args = ["trainer.accelerator=gpu", "trainer.devices=2", "launcher.cpus_per_rank=3"]
    err, _ = refused(args, workdir, cluster["address"])
    assert "trainer.devices=2: 2 ranks" in err, err
    assert "need 2 bundles of {CPU: 3, GPU: 1}" in err and "the Ray cluster holds 0" in err, err
    assert "CPU=4, GPU=0" in err and "CPU=2, GPU=1" in err, "each node's resources are shown"


def test_the_local_launcher_holds_a_cuda_job_to_this_machine(monkeypatch):
    """The other side of the device check: a launcher that runs its ranks here (the default of
    `checks_devices`) refuses CUDA on a machine without it."""
    from omegaconf import OmegaConf

    from framework.config import validate
    from framework.config.compose import compose_config
    from framework.errors import ConfigError

    monkeypatch.setattr(validate, "cuda_device_count", lambda: 0)  # also on a GPU machine
    cfg = compose_config(["task=digits", "trainer.accelerator=gpu", "trainer.devices=2"])
    OmegaConf.resolve(cfg)
    with pytest.raises(ConfigError, match="trainer.accelerator=gpu: no CUDA device is available"):
        validate.plan_job(cfg)


def test_an_unknown_placement_strategy_is_refused(workdir):
    err, _ = refused(["launcher.strategy=SPREAD_THIN"], workdir, "127.0.0.1:1")
    assert "launcher.strategy=SPREAD_THIN" in err and "STRICT_SPREAD" in err, err


def test_a_run_dir_one_node_does_not_see_is_refused(cluster, workdir):
    if cluster["private"] is None:
        pytest.skip("a private mount for the second node needs unshare as root")
    run = cluster["private"] / "run"
    err, _ = refused(["trainer.devices=2"], workdir, cluster["address"], run)
    assert f"run.dir={run}: the Ray cluster has 2 nodes" in err and "does not see" in err, err
    assert not run.exists() and not list(cluster["private"].iterdir()), "nothing left behind"
