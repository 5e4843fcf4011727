"""SIGTERM and SIGUSR1 (what SLURM sends before preempting) under every kind of strategy and
with one process: the job saves a checkpoint at the next step boundary, exits with code 75, and
the same command continues from it, each step logged once."""

from __future__ import annotations

import signal

import pytest

from tests.conftest import QUIET, assert_resumed, fw
from tests.distributed.test_resume import start, wait_for_step

pytestmark = pytest.mark.slow
STEPS = 16
COMMON = [
    "task.data.batch_size=32",
    f"trainer.max_steps={STEPS}",
    "trainer.log_every_n_steps=1",
    "callbacks.checkpoint.every_n_steps=100",  # only the preemption saves
    "logger=[csv]",
    *QUIET,
]
SLOW_STEP = ["task._target_=tests.tasks.SlowDigitsTask", "+task.model.step_sleep=0.15"]
SLOW_LOSS = [
    "task._target_=tests.tasks.SlowLossDigits",
    "+task.model.loss_sleep=0.08",
    "strategy.microbatches=2",
]
CASES = {
    "one-process": (["trainer.devices=1", *SLOW_STEP], signal.SIGUSR1),
    "zero2": (["strategy=zero2", "trainer.devices=2", *SLOW_STEP], signal.SIGTERM),
    "fsdp": (
        ["strategy=fsdp", "trainer.devices=2", *SLOW_STEP],
        signal.SIGUSR1,
    ),  # tensor: the same plugin and checkpoint IO
    "pipeline": (["strategy=pipeline", "trainer.devices=2", *SLOW_LOSS], signal.SIGUSR1),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_preemption_signal_saves_exits_75_and_the_job_continues(case, workdir):
    args, signum = CASES[case]
    run = workdir / "run"
    proc = start([*args, *COMMON, f"run.dir={run}"], workdir)
    wait_for_step(run, 5, proc)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err[-3000:]
    stopped = int(err.split("checkpoint saved at step ")[1].split(";")[0])
    assert 6 <= stopped < STEPS, err[-3000:]
    assert (run / "checkpoints" / f"step{stopped:08d}" / "meta.json").is_file()
    again = fw("train", *args, *COMMON, f"run.dir={run}", cwd=workdir)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"(step {stopped})" in again.stderr
    assert_resumed(again.stderr, run, STEPS)
