"""A task's exception that holds a secret value, under the launchers that run the task in a
process of their own: launcher=ray's rank prints it and reports it to `fw` with the secret
replaced; launcher=slurm's task re-raises it with its traceback redacted, so that what submitit
keeps of it (RUN_DIR/slurm/*_result.pkl) and prints holds no secret."""

from __future__ import annotations

import json
import pickle
import sys

import pytest

from framework import worker
from framework.secrets import ENV as SECRETS_ENV

SECRET = "hf_3c9e51a07d"


def fail_with_the_secret(*args, **kwargs):
    """The task, failing with the secret in its message (and in a cause's)."""
    try:
        raise ValueError(f"the cause saw {SECRET}")
    except ValueError as cause:
        raise RuntimeError(f"could not log in with token {SECRET}") from cause


@pytest.fixture
def secret_config(monkeypatch):
    """A job whose config holds the secret (handed to its processes as fw hands it)."""
    monkeypatch.setenv(SECRETS_ENV, json.dumps({"task.model.api_token": SECRET}))
    monkeypatch.setattr(sys, "path", list(sys.path))  # a launcher appends the user's directory
    monkeypatch.setattr(worker, "entry", fail_with_the_secret)


def test_a_ray_rank_prints_and_reports_a_task_exception_without_its_secret(
    secret_config, tmp_path, monkeypatch, capsys
):
    from framework.launchers.ray.ranks import Rank

    monkeypatch.chdir(tmp_path)
    outcome = Rank(0).run({}, str(tmp_path), str(tmp_path / "config.yaml"), "")
    printed = capsys.readouterr().err
    assert outcome["status"] == "failed"
    assert outcome["error"] == "RuntimeError: could not log in with token ***"
    assert "Traceback" in printed and "the cause saw ***" in printed, printed
    assert SECRET not in printed


def test_a_slurm_tasks_exception_reaches_submitits_result_file_without_its_secret(
    secret_config, tmp_path, monkeypatch
):
    """submitit's own job runner, in this process: it writes the traceback of what the task
    raised into the result file next to the job, and raises it again."""
    from submitit.core import job_environment, submission, utils

    from framework import external
    from framework.launchers import slurm
    from framework.world import World

    for name, value in {
        "SUBMITIT_EXECUTOR": "slurm",
        "SLURM_JOB_ID": "4242",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "0",
        "SLURM_NTASKS": "1",
        "SLURM_JOB_NUM_NODES": "1",
        "SLURM_JOB_NODELIST": "localhost",
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    # submitit's handlers for SLURM's signals stay out of the test process
    monkeypatch.setattr(job_environment.JobEnvironment, "_handle_signals", lambda *a: None)
    monkeypatch.setattr(external, "check_world", lambda world: None)
    monkeypatch.chdir(tmp_path)
    world = World(world_size=1, devices=1, num_nodes=1, accelerator="cpu")
    task = slurm.Task(str(tmp_path / "config.yaml"), "", "USR2", 0, world)
    utils.DelayedSubmission(task).dump(tmp_path / "4242_submitted.pkl")
    with pytest.raises(slurm.TaskFailed) as raised:
        submission.process_job(tmp_path)
    (result,) = tmp_path.glob("4242_*_result.pkl")
    with result.open("rb") as fh:
        status, kept = pickle.load(fh)  # noqa: S301 - the file this test's job just wrote
    assert status == "error"
    assert "RuntimeError: could not log in with token ***" in kept, kept
    assert "the cause saw ***" in kept, "the cause's traceback is kept too"
    assert SECRET not in kept
    assert SECRET not in str(raised.value)
