"""An elastic job (`launcher.min_nodes` below `trainer.num_nodes`) loses a node and grows back.

Two `fw` processes on this machine stand for two nodes (as in test_slurm.py). Node 2's fw
process is killed with -9 after the first checkpoint: node 1 goes on alone from that checkpoint
with the same global batch (twice the per-rank batch), and when node 2's command is started
again the job is back at two processes from the next step. The losses are those of an
uninterrupted two-process run, every step is logged once and every sample of the epoch is
trained once; under fsdp (its sharded checkpoint resharded from two ranks to one and
back) and zero2 (DeepSpeed's ZeRO partitions moved), against a ddp reference: the global
batch and the sample order are the same. Under launcher=slurm (a real two-node SLURM on this
machine, tests/slurm_cluster.py) node 2's agent task is killed and node 1 finishes alone."""

from __future__ import annotations

import ipaddress
import json
import os
import re
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from framework.data.sampler import GlobalOrderSampler
from tests.conftest import FW, QUIET, fw, fw_env, metric_rows, read_metrics, refused
from tests.distributed.test_listening import listening as sockets
from tests.distributed.test_slurm import cluster, job_state, wait_until_done  # noqa: F401
from tests.tasks import RecordingDigitsTask

STEPS = 20  # within the first epoch: every sample at most once
GLOBAL_BATCH = 64
ARGS = [
    "task._target_=tests.distributed.test_elastic.SlowRecordingDigits",
    "~task.model.dropout",
    "task.data._target_=tests.tasks.IndexedDigits",
    "~task.data.val_fraction",
    f"trainer.max_steps={STEPS}",
    "trainer.log_every_n_steps=1",
    "trainer.deterministic=true",
    "callbacks.checkpoint.every_n_steps=4",
    *QUIET,
]


class SlowRecordingDigits(RecordingDigitsTask):
    """Records its samples (RecordingDigitsTask), sleeps `step_sleep` each step, and alone (one
    process) holds at step `hold_step` while the file `<out>/hold` exists: the test releases it
    once the node started again has joined, so the job is still running when it does."""

    def __init__(
        self, out: str, hidden: int = 16, step_sleep: float = 0.1, hold_step: int = 8
    ) -> None:
        super().__init__(out, hidden=hidden)
        self.step_sleep, self.hold_step = step_sleep, hold_step

    def training_step(self, batch, batch_idx):
        time.sleep(self.step_sleep)
        hold = Path(self.out) / "hold"
        deadline = time.monotonic() + 120
        alone = self.trainer.world_size == 1 and self.trainer.global_step == self.hold_step
        while alone and hold.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return super().training_step(batch, batch_idx)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        # one line per step and rank, tagged with the step, so that steps a restart trains
        # again can be told apart
        path = os.path.join(self.out, f"seen-rank{self.global_rank}.txt")
        with open(path, "a") as fh:
            ids = " ".join(str(i) for i in self._idx.tolist())
            fh.write(f"{self.trainer.global_step - 1}:{self.trainer.world_size}:{ids}\n")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def node(args: list[str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [str(FW), "train", *args],
        cwd=cwd,
        # two "nodes" share this machine's cores: one thread each, as the reference's workers
        env={**fw_env(), "FW_RDZV_TOKEN": "job-token", "OMP_NUM_THREADS": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def wait_for(check, what: str, procs, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            assert p.poll() is None, f"{what}: a node ended: " + p.stderr.read()[-3000:]
        if check():
            return
        time.sleep(0.05)
    raise TimeoutError(what)


def follow(proc: subprocess.Popen) -> list[str]:
    """The lines of a process's stderr, read as they come (in a thread)."""
    lines: list[str] = []

    def read() -> None:
        for line in proc.stderr:
            lines.append(line)

    threading.Thread(target=read, daemon=True).start()
    return lines


def world_sizes(run: Path) -> list[tuple[int, int]]:
    if not (run / "metrics.csv").exists():
        return []
    rows = read_metrics(run)
    return [(int(r["step"]), int(float(r["world_size"]))) for r in rows if r.get("world_size")]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["launcher.min_nodes=3"], "launcher.min_nodes=3: more than trainer.num_nodes=2"),
        (["launcher.min_nodes=0"], "launcher.min_nodes"),
        # a shrink restarts the nodes left: none allowed ends the job at the first loss
        (
            ["launcher.min_nodes=1", "launcher.max_restarts=0"],
            "launcher.max_restarts=0: launcher.min_nodes=1 goes on after losing a node",
        ),
        # three nodes x 33 = 99 samples a step: two nodes cannot split them evenly
        (
            ["trainer.num_nodes=3", "launcher.min_nodes=2", "task.data.batch_size=33"],
            "on 2 node(s) (2 data-parallel ranks) no per-rank batch x accumulation keeps the "
            "global batch",
        ),
    ],
)
def test_a_bad_elastic_setting_is_refused_before_anything_starts(
    args, message, workdir, monkeypatch, capsys
):
    monkeypatch.setenv("FW_RDZV_TOKEN", "job-token")
    common = [
        "trainer.num_nodes=2",
        "trainer.devices=1",
        f"launcher.rdzv_endpoint=localhost:{free_port()}",
        "launcher.join_timeout_s=5",  # a check that let it through would wait for node 2
        "launcher.max_restarts=3",
    ]
    err = refused([*common, *args, *QUIET], workdir, monkeypatch, capsys)
    assert message in err, err


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The same training on two processes of one machine, uninterrupted."""
    cwd = tmp_path_factory.mktemp("reference")
    (cwd / "seen").mkdir()
    done = fw(
        "train",
        *ARGS,
        f"+task.model.out={cwd / 'seen'}",
        "trainer.devices=2",
        f"task.data.batch_size={GLOBAL_BATCH // 2}",
        "run.dir=run",
        cwd=cwd,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return cwd / "run"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["launcher.min_nodes=3"], "launcher.min_nodes=3: more than trainer.num_nodes=2"),
        (
            ["trainer.num_nodes=3", "launcher.min_nodes=2", "task.data.batch_size=33"],
            "on 2 node(s) (2 data-parallel ranks) no per-rank batch x accumulation keeps the "
            "global batch",
        ),
    ],
)
def test_launcher_slurm_refuses_a_bad_elastic_setting_before_submitting(
    args, message, workdir, tmp_path, monkeypatch, capsys
):
    """On any machine: an `sbatch` of the test's own first on PATH (launcher=slurm is refused
    without one), which records a call; nothing is submitted."""
    bin_dir, called = tmp_path / "bin", tmp_path / "sbatch-called"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(f"#!/bin/sh\ntouch {called}\nexit 1\n")
    (bin_dir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    common = ["launcher=slurm", "trainer.num_nodes=2", "trainer.devices=1"]
    err = refused([*common, *args, *QUIET], workdir, monkeypatch, capsys)
    assert message in err, err
    assert not called.exists(), "sbatch was called"


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [
        # ddp is not repeated here: its shrink and grow are these launcher steps, and its whole
        # state moving between process counts is test_resume.py's 2 -> 1 and 1 -> 2
        # sharded: the DCP checkpoint of two ranks is resharded for one, and one's for two
        ["strategy=fsdp"],
        # DeepSpeed: the engine's per-rank ZeRO shards of two ranks moved into one, and back
        ["strategy=zero2"],
    ],
    ids=["fsdp", "zero2"],
)
def test_a_lost_node_shrinks_the_job_and_its_return_grows_it(workdir, reference, layout):
    out = workdir / "seen"
    out.mkdir()
    (out / "hold").touch()
    port = free_port()
    args = [
        *ARGS,
        *layout,
        f"+task.model.out={out}",
        "trainer.devices=1",
        "trainer.num_nodes=2",
        f"task.data.batch_size={GLOBAL_BATCH // 2}",
        f"launcher.rdzv_endpoint=localhost:{port}",
        "launcher.min_nodes=1",
        "launcher.max_restarts=3",
        "launcher.join_timeout_s=60",
        "run.dir=run",
    ]
    run = workdir / "run"
    first = node(args, workdir)
    procs = [first]
    try:
        wait_for(lambda: listening(port), "node 1 hosts the rendezvous", procs)
        second = node(args, workdir)
        procs.append(second)
        wait_for(lambda: (out / "seen-rank1.txt").exists(), "both nodes train", procs)
        bound = listening_under([first.pid, second.pid])  # well before the kill at step 4
        wait_for(lambda: (run / "checkpoints" / "step00000004").exists(), "a checkpoint", procs)
        os.kill(second.pid, signal.SIGKILL)  # the whole node: its fw process, then its worker
        second.communicate(timeout=60)
        procs = [first]
        wait_for(lambda: any(w == 1 for _, w in world_sizes(run)), "node 1 goes on alone", procs)
        again = node(args, workdir)  # the same command, started again
        procs = [first, again]
        lines = follow(again)
        wait_for(lambda: any("Joining the running job" in x for x in lines), "joins", procs)
        (out / "hold").unlink()
        ends = [p.wait(timeout=240) for p in procs]
        errs = [first.communicate()[1], "\n".join(lines)]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    assert ends == [0, 0], errs[0][-3000:] + errs[1][-3000:]
    sizes = world_sizes(run)
    assert [s for s, _ in sizes] == list(range(STEPS)), "every step logged once"
    shape = [w for i, (_, w) in enumerate(sizes) if i == 0 or sizes[i - 1][1] != w]
    assert shape == [2, 1, 2], f"shrank to one process, grew back to two: {sizes}"
    got, want = dict(metric_rows(run)), dict(metric_rows(reference))
    assert sorted(got) == sorted(want) == list(range(STEPS))
    worst = max(abs(float(got[s]) - float(want[s])) for s in got)
    assert worst < 1e-5, f"losses differ from the uninterrupted run by up to {worst:g}"
    seen = trained_samples(out)
    assert seen == trained_samples(reference.parent / "seen"), "each step, the same samples"
    ids = [i for step in seen.values() for i in step]
    n_train = 1797 - int(1797 * 0.2)  # the digits train split
    order = GlobalOrderSampler(n_train, seed=0, num_replicas=1, rank=0).global_order().tolist()
    assert sorted(ids) == sorted(order[: STEPS * GLOBAL_BATCH]), "every sample once, none skipped"
    assert "World size 1 of 2" in errs[0], errs[0][-3000:]
    # a job over several machines listens where the endpoint and the first node are, never on
    # every interface: the rendezvous store on the endpoint's address (localhost here)
    assert f"127.0.0.1:{port}" in bound and len(bound) >= 2, bound  # and the workers' store
    assert not any(ipaddress.ip_address(a.rpartition(":")[0]).is_unspecified for a in bound), bound


def listening_under(roots: list[int]) -> set[str]:
    """host:port of every listening TCP socket of the processes `roots` and their descendants
    (one pass over /proc: the caller's job goes on meanwhile)."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    tree = set(roots)
    while grown := {pid for pid, parent in parents.items() if parent in tree} - tree:
        tree |= grown
    return sockets(sorted(tree))


def trained_samples(out: Path) -> dict[int, list[int]]:
    """The sample ids each step trained, as the last start that ran the step recorded them."""
    by_step: dict[int, dict[int, tuple[int, list[int]]]] = {}
    for rank_file in sorted(out.glob("seen-rank*.txt")):
        rank = int(rank_file.stem.removeprefix("seen-rank"))
        for line in rank_file.read_text().splitlines():
            step, world, ids = line.split(":")
            by_step.setdefault(int(step), {})[rank] = (int(world), [int(i) for i in ids.split()])
    steps = {}
    for step, ranks in sorted(by_step.items()):
        world = ranks[0][0]  # a rank above the last start's world size is from an earlier one
        steps[step] = sorted(i for r, (_, ids) in ranks.items() if r < world for i in ids)
    return steps


# --- launcher=slurm: a real two-node SLURM cluster on this machine (tests/slurm_cluster.py)


def agent_of(job: str, node: int) -> int:
    """The pid of the elastic SLURM job's agent task on `node` (started by slurmstepd)."""
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            env = dict(
                item.split("=", 1) for item in environ.read_text().split("\0") if "=" in item
            )
            status = (environ.parent / "status").read_text()
            ppid = next(x.split()[1] for x in status.splitlines() if x.startswith("PPid:"))
            parent = Path(f"/proc/{ppid}/comm").read_text().strip()
        except (OSError, ValueError, StopIteration):
            continue
        mine = env.get("SLURM_JOB_ID") == job and env.get("SLURM_PROCID") == str(node)
        if mine and "SLURM_STEP_ID" in env and parent == "slurmstepd":
            return int(environ.parent.name)
    raise LookupError(f"no agent of SLURM job {job} on node {node}")


@pytest.mark.slow
def test_a_lost_node_shrinks_a_slurm_job(cluster, workdir, reference):  # noqa: F811
    """launcher=slurm with min_nodes: one agent per node; node 2's agent killed with -9 after the
    first checkpoint, SLURM lets node 1's task run on, and it finishes the job alone."""
    out = workdir / "seen"
    out.mkdir()
    args = [
        *ARGS,
        f"+task.model.out={out}",
        "launcher=slurm",
        "trainer.devices=1",
        "trainer.num_nodes=2",
        f"task.data.batch_size={GLOBAL_BATCH // 2}",
        "launcher.min_nodes=1",
        "run.dir=run",
    ]
    # two "nodes" share this machine's cores: one thread each, as the reference's workers
    env = {**fw_env(), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [str(FW), "train", *args], cwd=workdir, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (job,) = re.findall(r"Submitted SLURM job (\d+) ", done.stderr)
    run = workdir / "run"
    try:
        deadline = time.monotonic() + 180
        while not (run / "checkpoints" / "step00000004").exists():
            assert job_state(job) and time.monotonic() < deadline, f"job {job}: no checkpoint"
            time.sleep(0.05)
        os.kill(agent_of(job, 1), signal.SIGKILL)  # node 2: its agent, then its worker
        wait_until_done(job)
    finally:
        subprocess.run(["scancel", job], check=False)
    log = (run / "slurm" / f"{job}_0_log.err").read_text()
    sizes = world_sizes(run)
    assert [s for s, _ in sizes] == list(range(STEPS)), "every step logged once: " + log[-3000:]
    shape = [w for i, (_, w) in enumerate(sizes) if i == 0 or sizes[i - 1][1] != w]
    assert shape == [2, 1], f"shrank to one process: {sizes}"
    got, want = dict(metric_rows(run)), dict(metric_rows(reference))
    worst = max(abs(float(got[s]) - float(want[s])) for s in want)
    assert worst < 1e-5, f"losses differ from the uninterrupted run by up to {worst:g}"
    assert trained_samples(out) == trained_samples(reference.parent / "seen"), "same samples"
    assert "World size 1 of 2" in log and "Restart 1 of 1" in log, log[-3000:]
    (restart,) = json.loads((run / "run.json").read_text())["restarts"]
    # the survivor's workers failed on the lost peer, not on a signal: SLURM did not end the step
    assert "signal" not in restart["cause"], restart["cause"]
