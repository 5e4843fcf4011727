"""Runs survive: kill -9 / SIGTERM and restart continue exactly; resume across process counts."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from framework.data.sampler import GlobalOrderSampler
from tests.conftest import FW, QUIET, fw, fw_env, metric_rows, read_metrics
from tests.distributed.conftest import REFERENCE, RUNS

pytestmark = pytest.mark.slow
STEPS = 40
SLOW = [
    "task._target_=tests.tasks.SlowDigitsTask",
    "task.model.hidden=64",
    "task.model.dropout=0.1",
    "+task.model.step_sleep=0.08",
    "task.data.batch_size=32",
    "trainer.devices=2",
    f"trainer.max_steps={STEPS}",
    "trainer.log_every_n_steps=1",
    "trainer.deterministic=true",
    "callbacks.checkpoint.every_n_steps=5",
    "trainer.val_check_interval=10",
    *QUIET,
]


def final_weights(run: Path) -> dict[str, torch.Tensor]:
    state = torch.load(run / "checkpoints" / "last" / "state.ckpt", weights_only=True)
    return state["state_dict"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("reference") / "run"
    result = fw("train", *SLOW, f"run.dir={run}")
    assert result.returncode == 0, result.stderr[-3000:]
    return run


def start(args: list[str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [str(FW), "train", *args],
        cwd=cwd,
        env=fw_env(),
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for_step(run: Path, step: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        if (run / "metrics.csv").exists() and any(s >= step for s, _ in metric_rows(run)):
            return
        time.sleep(0.02)
    raise TimeoutError(f"step {step} not reached")


def assert_same_as_reference(run: Path, reference: Path) -> None:
    got, want = metric_rows(run), metric_rows(reference)
    assert [s for s, _ in got] == list(range(STEPS)), "each step exactly once"
    assert got == want, "losses after the restart are bitwise those of the uninterrupted run"
    a, b = final_weights(run), final_weights(reference)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def kill_then_restart(args: list[str], run: Path, kill_step: int, workdir: Path) -> str:
    """Start a job, SIGKILL all its processes once `kill_step` is logged, rerun it; its stderr."""
    proc = start([*args, f"run.dir={run}"], workdir)
    wait_for_step(run, kill_step, proc)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    again = fw("train", *args, f"run.dir={run}", cwd=workdir)
    assert again.returncode == 0, again.stderr[-3000:]
    return again.stderr


def test_a_killed_worker_is_restarted_and_the_job_finishes_exactly(reference, workdir):
    from framework.launch.signals import child_pids

    run = workdir / "run"
    proc = start([*SLOW, "launcher.max_restarts=1", f"run.dir={run}"], workdir)
    try:
        wait_for_step(run, 12, proc)
        workers = sorted(child_pids(proc.pid))
        assert len(workers) == 2, workers
        os.kill(workers[1], signal.SIGKILL)
        err = proc.communicate(timeout=300)[1]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, err[-3000:]
    assert "Restart 1 of 1 after: rank" in err and "killed by signal SIGKILL" in err, err[-3000:]
    assert "(restart 1)" in err, "the restarted workers resumed from a checkpoint"
    restarts = json.loads((run / "run.json").read_text())["restarts"]
    assert [r["attempt"] for r in restarts] == [1] and "SIGKILL" in restarts[0]["cause"]
    assert_same_as_reference(run, reference)


@pytest.mark.parametrize("seed", [0])  # a worker killed at another step: the restart test
def test_kill_9_at_a_random_step_then_restart_is_exact(seed, reference, workdir):
    kill_step = random.Random(seed).randint(3, STEPS - 5)
    err = kill_then_restart(SLOW, workdir / "run", kill_step, workdir)
    assert "Resuming from" in err or kill_step < 5
    assert_same_as_reference(workdir / "run", reference)


def test_a_kill_right_after_a_commit_loses_no_metrics_row(reference, workdir):
    """The checkpoint of step 10 commits only once step 9's metrics (training and validation)
    are in metrics.csv: the job killed the moment the commit shows has every row before 10, and
    the rerun resumes at 10, each step logged once."""
    run, marker = workdir / "run", workdir / "killed"
    args = [
        *(a for a in SLOW if not a.startswith("task._target_=")),
        "task._target_=tests.tasks.KillAfterCommitDigits",
        "+task.model.after=10",
        f"+task.model.ckpts={run / 'checkpoints'}",
        f"+task.model.marker={marker}",
        f"run.dir={run}",
    ]
    first = fw("train", *args, cwd=workdir)
    assert first.returncode != 0 and marker.exists(), first.stderr[-3000:]
    assert (run / "checkpoints" / "step00000010").is_dir()
    assert [s for s, _ in metric_rows(run)] == list(range(10)), "rows up to the commit's step"
    assert read_metrics(run)[-1].get("val/loss"), "the step's validation metrics too"
    again = fw("train", *args, cwd=workdir)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "Resuming from" in again.stderr and "step00000010" in again.stderr, again.stderr[-3000:]
    assert_same_as_reference(run, reference)


def test_kill_during_a_save_leaves_no_damage(reference, workdir):
    run = workdir / "run"
    marker = workdir / "killed"
    killer = [
        "+callbacks.killer._target_=tests.tasks.KillDuringSave",
        "+callbacks.killer.step=15",
        f"+callbacks.killer.marker={marker}",
    ]
    first = fw("train", *SLOW, *killer, f"run.dir={run}", cwd=workdir)
    assert first.returncode != 0 and marker.exists()
    assert (run / "checkpoints" / "step00000015.tmp").is_dir()
    again = fw("train", *SLOW, *killer, f"run.dir={run}", cwd=workdir)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "step00000010" in again.stderr  # resumed from the last complete checkpoint
    assert not (run / "checkpoints" / "step00000015.tmp").exists()
    assert_same_as_reference(run, reference)


def test_sigterm_checkpoints_exits_75_and_the_restart_is_exact(reference, workdir):
    run = workdir / "run"
    proc = start([*SLOW, f"run.dir={run}"], workdir)
    wait_for_step(run, 11, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err[-3000:]
    stopped = int(err.split("checkpoint saved at step ")[1].split(";")[0])
    # the signal's own save: the step or two after it, not a regular every-5-steps one
    assert 12 <= stopped <= 14, err[-3000:]
    # the step the message names is where the workers stopped: its checkpoint is there, and
    # every step before it was logged once, none after it
    assert (run / "checkpoints" / f"step{stopped:08d}").is_dir()
    assert [s for s, _ in metric_rows(run)] == list(range(stopped)), err[-3000:]
    again = fw("train", *SLOW, f"run.dir={run}", cwd=workdir)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"step{stopped:08d}" in again.stderr
    assert_same_as_reference(run, reference)


@pytest.mark.parametrize("corruption", ["truncated", "corrupted"])
def test_damaged_newest_checkpoint_is_skipped(corruption, one_process, workdir):
    """The session's one-process digits run (checkpoints at 10 and 20) with step 20 damaged."""
    shutil.copytree(one_process["root"] / "digits", workdir / "run", symlinks=True)
    args = [*REFERENCE, *(a for a in RUNS["digits"] if "max_steps" not in a), "run.dir=run"]
    state = workdir / "run" / "checkpoints" / "step00000020" / "state.ckpt"
    data = state.read_bytes()
    if corruption == "truncated":
        state.write_bytes(data[: len(data) // 2])
    else:
        state.write_bytes(data[:1000] + bytes(b ^ 0xFF for b in data[1000:1100]) + data[1100:])
    again = fw("train", *args, "trainer.max_steps=30", cwd=workdir)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "Skipping checkpoint" in again.stderr and corruption in again.stderr
    assert "step00000010 (step 10)" in again.stderr


def seen(out: Path) -> list[int]:
    return [
        int(i)
        for f in sorted(out.glob("seen-rank*.txt"))
        for line in f.read_text().split("\n")
        for i in line.split()
    ]


@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2)])
def test_resume_with_another_process_count_sees_every_sample_once(before, after, workdir):
    out = workdir / "seen"
    out.mkdir()
    global_batch = 64
    common = [
        "task._target_=tests.tasks.RecordingDigitsTask",
        f"+task.model.out={out}",
        "~task.model.dropout",
        "task.data._target_=tests.tasks.IndexedDigits",
        "~task.data.val_fraction",
        *QUIET,
        "run.dir=run",
    ]
    first = fw(
        "train",
        *common,
        f"trainer.devices={before}",
        f"task.data.batch_size={global_batch // before}",
        "trainer.max_steps=10",
        cwd=workdir,
    )
    assert first.returncode == 0, first.stderr[-3000:]
    second = fw(
        "train",
        *common,
        f"trainer.devices={after}",
        f"task.data.batch_size={global_batch // after}",
        "trainer.max_steps=22",
        cwd=workdir,
    )
    assert second.returncode == 0, second.stderr[-3000:]
    got = seen(out)
    n_train = 1797 - int(1797 * 0.2)  # the digits train split
    order = GlobalOrderSampler(n_train, seed=0, num_replicas=1, rank=0).global_order().tolist()
    assert len(got) == len(set(got)) == 22 * global_batch, "no sample repeated"
    assert sorted(got) == sorted(order[: 22 * global_batch]), "no sample skipped"


def descendants(pid: int) -> set[int]:
    """Every process below `pid` (children, their children, ...), read from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has exited


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_workers_die_with_a_kill_9_of_fw_alone(method, workdir):
    """Only the `fw` process is killed (not its process group): no worker goes on training,
    whether the workers were forked from it or started as fresh interpreters (CUDA's way)."""
    run = workdir / "run"
    long = [a for a in SLOW if "max_steps" not in a] + ["trainer.max_steps=1000"]  # minutes
    proc = start([*long, f"launcher.start_method={method}", f"run.dir={run}"], workdir)
    wait_for_step(run, 3, proc)
    workers = descendants(proc.pid)
    assert len(workers) >= 2, "the job runs its workers below fw"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 10
    while any(alive(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    survivors = [p for p in workers if alive(p)]
    for pid in survivors:  # leave no orphan behind, even when failing
        os.kill(pid, signal.SIGKILL)
    assert not survivors, "a worker outlived fw"
    rows = len(metric_rows(run))
    time.sleep(1.0)
    assert len(metric_rows(run)) == rows, "nothing trains after fw died"
