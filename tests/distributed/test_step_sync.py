"""What Lightning adds to every step of a multi-process job, made cheap (framework/strategy_base.py
and framework/runtime/vote.py): a step issues no barrier and no broadcast, the loss logged
with `sync_dist` is the mean over the ranks with one all-reduce, and SIGTERM is still voted on,
without waiting: every rank stops at the same step, and the job ends with exit code 143 and says
so (it used to hang: Lightning's SIGTERMException ends a worker as a success, with no result for
the launcher)."""

from __future__ import annotations

import contextlib
import json
import os
import signal

import pytest

from tests.conftest import QUIET, metric_rows
from tests.distributed.test_resume import start, wait_for_step

pytestmark = pytest.mark.slow
COMMON = [
    "strategy=ddp",
    "trainer.devices=2",
    "task.data.batch_size=32",
    "trainer.log_every_n_steps=1",
    "logger=[csv]",
    *QUIET,
]


def test_a_step_issues_one_all_reduce_for_its_logged_loss_and_no_barrier_or_broadcast(workdir):
    from tests.conftest import fw

    run = workdir / "run"
    result = fw(
        "train", *COMMON, "trainer.max_steps=8", "+callbacks.spy._target_=tests.tasks.StepCollectives",
        f"run.dir={run}", cwd=workdir,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [json.loads((run / f"collectives-rank{r}.json").read_text()) for r in (0, 1)]
    for found in ranks:
        steps = found["steps"]
        # the logged loss's all-reduce, and the SIGTERM vote's (started, read a step later)
        assert found["counts"] == {"all_reduce": steps, "all_reduce (async)": steps}, found
    logged = {step: float(loss) for step, loss in metric_rows(run)}
    means = {
        int(step): (loss + ranks[1]["losses"][step]) / 2
        for step, loss in ranks[0]["losses"].items()
    }
    assert ranks[0]["losses"] != ranks[1]["losses"]  # the ranks' batches differ
    # Lightning writes a step's metrics under the number of steps before it
    assert {step - 1: logged[step - 1] for step in means} == pytest.approx(
        {step - 1: mean for step, mean in means.items()}, rel=1e-6
    )


def test_sigterm_without_checkpoints_stops_every_rank_at_one_step_and_exits_143(workdir):
    run = workdir / "run"
    args = [
        *COMMON, "trainer.max_steps=40", "~callbacks.checkpoint",
        "task._target_=tests.tasks.SlowDigitsTask", "+task.model.step_sleep=0.15", f"run.dir={run}",
    ]  # fmt: skip
    proc = start(args, workdir)
    wait_for_step(run, 5, proc)
    proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # a job that hangs leaves nothing behind
    assert proc.returncode == 143, err[-3000:]
    assert "stopped on SIGTERM without a checkpoint" in err, err[-3000:]
    last = max(step for step, _ in metric_rows(run))
    assert 5 <= last < 10, last  # at the next step boundaries, not at max_steps
    assert not any((run / "checkpoints").glob("step*"))
