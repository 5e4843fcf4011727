"""Jobs over several processes that `fw` did not start alone.

Inside a SLURM allocation: `fw train` started by `srun` in every task joins as the rank that task
is, names its run directory after the job, and refuses a process layout that does not match the
allocation. The tasks are started as `srun -N1 -n2 fw train ...` starts them: two `fw` processes
with the variables srun sets (no real SLURM needed).

Several machines without SLURM: the same `fw train ... trainer.num_nodes=2` started on each
machine forms one job; two `fw` processes on this machine stand for two nodes."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import time
from pathlib import Path

import pytest

from framework.external import tasks_per_node
from tests.conftest import FW, QUIET, fw, fw_env, metric_rows, refused

pytestmark = pytest.mark.slow
ARGS = ["trainer.max_steps=6", "trainer.log_every_n_steps=1", "trainer.deterministic=true", *QUIET]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def srun(args: list[str], cwd, ntasks: int = 2, per_node: str | None = None, extra=None):
    """Start `fw train ARGS` in `ntasks` tasks with srun's variables; their results."""
    port = free_port()
    procs = []
    for rank in range(ntasks):
        env = fw_env()
        env.update(
            SLURM_JOB_ID="4242",
            SLURM_JOB_NAME="train",
            SLURM_NTASKS=str(ntasks),
            SLURM_PROCID=str(rank),
            SLURM_LOCALID=str(rank),
            SLURM_NODEID="0",
            SLURM_NNODES="1",
            SLURM_JOB_NUM_NODES="1",
            SLURM_NODELIST="localhost",
            SLURM_TASKS_PER_NODE=per_node or str(ntasks),  # srun -n N sets no SLURM_NTASKS_PER_NODE
            MASTER_PORT=str(port),
            **(extra or {}),
        )
        procs.append(
            subprocess.Popen(
                [str(FW), "train", *args],
                cwd=cwd,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
        )
    return [(p.wait(timeout=300), p.communicate()[1]) for p in procs]


@pytest.fixture(scope="module")
def local_run(tmp_path_factory) -> Path:
    """The same training by the local launcher, two processes on this machine."""
    cwd = tmp_path_factory.mktemp("local")
    local = fw("train", "trainer.devices=2", *ARGS, "run.dir=local", cwd=cwd)
    assert local.returncode == 0, local.stderr[-3000:]
    return cwd / "local"


def test_srun_n2_joins_as_its_ranks_and_matches_the_local_launcher(workdir, local_run):
    results = srun(["trainer.devices=2", *ARGS], workdir)
    assert [code for code, _ in results] == [0, 0], results[0][1][-3000:]
    run = workdir / "runs" / "slurm-4242"
    assert [s for s, _ in metric_rows(run)] == list(range(6))
    assert sum(1 for _ in (workdir / "runs").iterdir()) == 1, "one run directory for the job"
    assert metric_rows(run) == metric_rows(local_run), "bitwise the local launcher's"


def nodes(
    per_node: list[list[str]], cwd: Path, tokens: tuple[str, ...] = ("job-token", "job-token")
) -> list[tuple[int, str]]:
    """`fw train` once per node (each with its own arguments and FW_RDZV_TOKEN), rendezvous on
    this machine."""
    endpoint = f"launcher.rdzv_endpoint=localhost:{free_port()}"
    procs = [
        subprocess.Popen(
            [
                str(FW),
                "train",
                "trainer.num_nodes=2",
                endpoint,
                "run.dir=nodes",
                "launcher.join_timeout_s=60",
                *args,
            ],
            cwd=cwd,
            # two "nodes" share this machine's cores: one thread each, as the two workers of
            # the one-machine run get (a node alone would take every core, and the float
            # results of a step can depend on the thread count)
            env={**fw_env(), "FW_RDZV_TOKEN": token, "OMP_NUM_THREADS": "1"},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for args, token in zip(per_node, tokens, strict=True)
    ]
    return [(p.wait(timeout=300), p.communicate()[1]) for p in procs]


def test_two_nodes_form_one_job_that_matches_the_local_launcher(workdir, local_run):
    results = nodes([["trainer.devices=1", *ARGS]] * 2, workdir)
    assert [code for code, _ in results] == [0, 0], results[0][1][-3000:] + results[1][1][-3000:]
    assert sum("Run directory:" in err for _, err in results) == 1, "one node writes the run dir"
    run = workdir / "nodes"
    assert [s for s, _ in metric_rows(run)] == list(range(6))
    assert metric_rows(run) == metric_rows(local_run), "bitwise two processes on one machine"


def test_a_node_started_with_another_config_is_refused_before_anything_is_written(workdir):
    base = ["trainer.devices=1", *ARGS]
    results = nodes([base, [*base, "task.optimizer.lr=0.1"]], workdir)
    for code, err in results:
        assert code == 2, err[-3000:]
        assert "the nodes of one job composed different configs" in err, err[-3000:]
        assert "task.optimizer.lr=" in err and "Traceback" not in err
    assert not (workdir / "nodes").exists(), "nothing written"


def test_a_node_without_the_jobs_token_is_refused_before_anything_is_written(workdir):
    """A stranger who reaches the rendezvous port cannot join: its config is not signed with
    the job's token (both sides refuse, naming the token, and nothing starts)."""
    base = ["trainer.devices=1", *ARGS]
    results = nodes([base, base], workdir, tokens=("job-token", "a-guess"))
    for code, err in results:
        assert code == 2, err[-3000:]
        assert "without this job's token" in err and "Traceback" not in err, err[-3000:]
        assert "job-token" not in err and "a-guess" not in err, "no token on the console"
    assert not (workdir / "nodes").exists(), "nothing written"


def test_several_nodes_need_a_token(workdir, monkeypatch, capsys):
    monkeypatch.delenv("FW_RDZV_TOKEN", raising=False)
    args = ["trainer.num_nodes=2", "trainer.devices=1", "launcher.rdzv_endpoint=localhost:29511"]
    err = refused(args, workdir, monkeypatch, capsys)
    assert "launcher.rdzv_token" in err and "FW_RDZV_TOKEN" in err, err


def test_several_nodes_need_a_fixed_rendezvous_address(workdir, monkeypatch, capsys):
    err = refused(["trainer.num_nodes=2", "trainer.devices=1"], workdir, monkeypatch, capsys)
    assert "launcher.rdzv_endpoint=localhost:0" in err and "fixed host:port" in err


@pytest.mark.parametrize(
    ("devices", "per_node", "message"),
    [
        (1, None, "devices x num_nodes = 1 but the enclosing job has 2 processes"),
        (2, "1(x2)", "SLURM placed 1(x2) tasks per node on 2 node(s)"),
    ],
)
def test_a_layout_that_does_not_match_the_allocation_is_refused(
    devices, per_node, message, workdir
):
    results = srun([f"trainer.devices={devices}", *ARGS], workdir, per_node=per_node)
    for code, err in results:
        assert code == 2, err[-3000:]
        assert message in err and "Traceback" not in err
    assert not (workdir / "runs").exists(), "nothing written"


def test_slurm_task_counts_are_read_per_node():
    assert tasks_per_node("2") == [2]
    assert tasks_per_node("4,2(x2)") == [4, 2, 2]
    with pytest.raises(ValueError):
        tasks_per_node("two")


# --- launcher=slurm, against a real one-node SLURM cluster on this machine (tests/slurm_cluster.py)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """munged, slurmctld and slurmd, started for these tests (installed first when missing)."""
    from tests import slurm_cluster

    why = slurm_cluster.install()
    if why is not None:
        pytest.skip(f"no SLURM on this machine: {why}")
    running = slurm_cluster.Cluster(tmp_path_factory.mktemp("slurm"))
    running.start()
    before = os.environ.get("SLURM_CONF")
    os.environ.update(running.env)
    yield running
    running.stop()
    if before is None:
        os.environ.pop("SLURM_CONF", None)
    else:
        os.environ["SLURM_CONF"] = before


SLOW = ["task._target_=tests.tasks.SlowDigitsTask", "trainer.devices=2", *ARGS]


def submit(args: list[str], cwd: Path, *flags: str) -> list[str]:
    """`fw train launcher=slurm ARGS`: the ids of the SLURM jobs it submitted."""
    done = fw("train", *flags, "launcher=slurm", *args, cwd=cwd)
    assert done.returncode == 0, done.stderr[-3000:]
    return re.findall(r"Submitted SLURM job (\d+) ", done.stderr)


def job_state(job: str) -> str:
    out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True)
    return out.stdout.strip()


def wait_until_done(job: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while job_state(job):
        assert time.monotonic() < deadline, f"SLURM job {job} still {job_state(job)}"
        time.sleep(0.5)


def wait_for_rows(run: Path, rows: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not ((run / "metrics.csv").exists() and len(metric_rows(run)) >= rows):
        assert time.monotonic() < deadline, f"step {rows - 1} not logged in {run}"
        time.sleep(0.2)


def test_launcher_slurm_validates_where_sbatch_is_installed(cluster):
    from omegaconf import OmegaConf

    from framework.config.compose import compose_config
    from framework.config.validate import plan_job

    cfg = compose_config(["launcher=slurm"])
    OmegaConf.resolve(cfg)
    assert plan_job(cfg).world.world_size == 1


def test_a_submitted_two_task_job_matches_the_local_launcher(cluster, workdir, local_run):
    (job,) = submit(["trainer.devices=2", *ARGS, "run.dir=job"], workdir)
    wait_until_done(job)
    run = workdir / "job"
    logs = sorted(p.name for p in (run / "slurm").glob(f"{job}_*_log.err"))
    assert logs == [f"{job}_0_log.err", f"{job}_1_log.err"], "one log per rank in the run dir"
    assert metric_rows(run) == metric_rows(local_run), (run / "slurm" / logs[0]).read_text()[-3000:]


def test_the_preemption_signal_requeues_the_job_into_the_same_run(cluster, workdir, local_run):
    run = workdir / "job"
    args = [*SLOW, "+task.model.step_sleep=1.0", "logger.wandb.mode=offline", "run.dir=job"]
    (job,) = submit(args, workdir)
    wait_for_rows(run, 2)
    subprocess.run(["scancel", "--signal=USR2", job], check=True)  # what --signal=USR2@120 sends
    wait_until_done(job)
    log = "".join(p.read_text() for p in (run / "slurm").glob(f"{job}_0_log.err"))
    assert f"requeueing SLURM job {job} (1)" in log, log[-3000:]
    assert "(restart 1)" in log, "the requeued job resumed from the checkpoint"
    assert metric_rows(run) == metric_rows(local_run), "each step once, bitwise uninterrupted"
    run_id = json.loads((run / "run.json").read_text())["run_id"]
    wandb_runs = sorted((run / "wandb").glob("offline-run-*"))
    assert len(wandb_runs) == 2 and all(r.name.endswith(run_id) for r in wandb_runs)


def test_a_job_cancelled_by_scancel_resumes_when_submitted_again(cluster, workdir, local_run):
    run = workdir / "job"
    args = [*SLOW, "+task.model.step_sleep=1.0", "run.dir=job"]
    (job,) = submit(args, workdir)
    wait_for_rows(run, 2)
    subprocess.run(["scancel", job], check=True)
    wait_until_done(job)
    assert list((run / "checkpoints").glob("step*")), "SIGTERM saved a checkpoint"
    assert len(metric_rows(run)) < 6, "stopped before the end (not requeued)"
    (again,) = submit(args, workdir)
    wait_until_done(again)
    log = (run / "slurm" / f"{again}_0_log.err").read_text()
    assert "Resuming from" in log, log[-3000:]
    assert metric_rows(run) == metric_rows(local_run), "each step once, bitwise uninterrupted"


def test_a_two_combination_sweep_submits_two_jobs_with_their_own_run_dirs(cluster, workdir):
    jobs = submit(
        ["trainer.devices=1", "trainer.max_steps=2,3", *ARGS[1:], "run.dir=sweep"], workdir, "-m"
    )
    assert len(jobs) == 2, jobs
    for job in jobs:
        wait_until_done(job)
    assert [len(metric_rows(workdir / "sweep" / n)) for n in "01"] == [2, 3]


def test_launcher_slurm_without_sbatch_is_refused(workdir, monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch there
    err = refused(["launcher=slurm"], workdir, monkeypatch, capsys)
    assert "sbatch is not on PATH" in err
