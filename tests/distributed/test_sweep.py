"""`fw sweep`: a TPE search whose trials are 2-process `fw train` jobs, killed mid-trial and
continued by rerunning the command in two processes at once on the same study; a trial pruned
from its validation curve; bad input refused with exit code 2."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tests.conftest import FW, QUIET, fw, fw_env

pytestmark = pytest.mark.slow

TINY = ["logger=[csv]", "callbacks=none", "trainer.limit_train_batches=3", *QUIET]
LR = "task.optimizer.lr=tag(log, interval(1e-4, 1e-2))"
# seed 0 draws lr 1.3e-3 for trial 0, then 6.8e-4 for trial 1: after 3 steps trial 1's val/loss
# is clearly above trial 0's (2.28 vs 2.21), so the median pruner, counting from the first
# finished trial, prunes it at its first validation
SEARCH = [
    LR,
    "--trials",
    "5",
    "sweep.seed=0",
    "sweep.pruner_args.n_startup_trials=1",
    "trainer.devices=2",
    "trainer.max_epochs=2",
    *TINY,
    "run.dir=search",
]


def states(db: Path) -> dict[int, str]:
    """Trial number -> state, read from the study's SQLite file as another process may."""
    try:
        with sqlite3.connect(db, timeout=30) as conn:
            return dict(conn.execute("SELECT number, state FROM trials"))
    except sqlite3.OperationalError:  # not created yet
        return {}


def load(sweep: Path):
    import optuna

    return optuna.load_study(study_name=sweep.name, storage=f"sqlite:///{sweep / 'optuna.db'}")


def sweep(args: list[str], cwd: Path, log: Path) -> subprocess.Popen:
    """`fw sweep ARGS` started as from a shell (its own process group), output into `log`."""
    with log.open("w") as out:
        return subprocess.Popen(
            [str(FW), "sweep", *args],
            cwd=cwd,
            env=fw_env(),
            start_new_session=True,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def test_a_killed_search_continues_in_two_processes_and_prunes(workdir):
    study = workdir / "search"
    proc = sweep(SEARCH, workdir, workdir / "first.log")
    try:  # kill the sweep, its `fw train` and their workers once trial 3 runs
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline and proc.poll() is None:
            if states(study / "optuna.db").get(3) == "RUNNING":
                break
            time.sleep(0.5)
        assert proc.poll() is None, (workdir / "first.log").read_text()[-3000:]
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    before = states(study / "optuna.db")
    assert before == {0: "COMPLETE", 1: "PRUNED", 2: "PRUNED", 3: "RUNNING"}, before

    # the same command, twice at once on the same study
    procs = [sweep(SEARCH, workdir, workdir / f"again{i}.log") for i in (0, 1)]
    codes = [p.wait(timeout=240) for p in procs]
    logs = [(workdir / f"again{i}.log").read_text() for i in (0, 1)]
    assert codes == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    assert "Trial 3 was running when its sweep process" in logs[0] + logs[1]
    ran = [set(log.split("This process ran trials ")[1].split(".")[0].split(", ")) for log in logs]
    assert ran[0] and ran[1] and not ran[0] & ran[1], ran  # different trials in each process
    assert ran[0] | ran[1] == {"4", "5"}, "finished trials are not rerun"
    trials = {t.number: t for t in load(study).trials}
    assert trials[3].state.name == "FAIL", "the killed trial is marked failed, not counted"
    finished = [t for t in trials.values() if t.state.name in ("COMPLETE", "PRUNED")]
    assert sorted(t.number for t in finished) == [0, 1, 2, 4, 5]
    assert all(t.value is not None for t in finished), "each finished trial has its value"
    lrs = [t.params["task.optimizer.lr"] for t in finished]
    assert len(set(lrs)) == 5, "no values drawn twice"
    assert OmegaConf.load(study / "0" / "config.yaml").trainer.devices == 2

    assert trials[1].state.name == "PRUNED"
    assert (study / "1" / "pruned.json").is_file()
    assert "Trial 1 pruned at step 3" in (study / "1" / "train.log").read_text()
    summary = (study / "summary.txt").read_text()
    assert "Best: trial" in summary and "fw train trainer.devices=2" in summary, summary
    assert (study / "history.png").stat().st_size > 0


def test_bad_input_exits_2(workdir, monkeypatch, capsys):
    from framework.cli import main

    monkeypatch.chdir(workdir)
    for args, message in [
        ([LR, "--trials", "0"], "--trials=0: must be at least 1."),
        (
            ["task.optimizer.lr=normal(0, 1)", "--trials", "2"],
            "task.optimizer.lr=normal(0, 1): unknown distribution 'normal'.",
        ),
    ]:
        assert main(["sweep", *args]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {message}") and len(err.splitlines()) == 1, err
    assert list(workdir.iterdir()) == [], "nothing written"

    args = [LR, "--trials", "3", "sweep.metric=val/nope", "trainer.max_epochs=1", *TINY]
    result = fw("sweep", *args, "run.dir=s", cwd=workdir)
    assert result.returncode == 2, result.stderr[-3000:]
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith("error: sweep.metric=val/nope: trial 0 finished without logging it")
    assert "Valid choices: val/acc, val/loss." in error, error
    assert states(workdir / "s" / "optuna.db") == {0: "FAIL"}, "the study is kept"
