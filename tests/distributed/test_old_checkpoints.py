"""Checkpoints written by an older version of the framework still resume (tests/fixtures): an
FSDP2 `dcp` one and a pipeline `dcp_flat` one, each made by 2 processes at step 10 before the
strategies became presets of one plugin. The resumed run continues as a fresh run of today's code
does, step for step."""

from __future__ import annotations

import shutil

import pytest

from tests.conftest import QUIET, REPO, fw, metric_rows

pytestmark = pytest.mark.slow
FIXTURES = REPO / "tests" / "fixtures" / "checkpoints"
COMMON = [
    *QUIET,
    "trainer.deterministic=true",
    "trainer.log_every_n_steps=1",
    "logger=[csv]",
    "callbacks.checkpoint.every_n_steps=10",
    "trainer.max_steps=20",
]
CASES = {
    "dcp": [
        "strategy=fsdp",
        "trainer.devices=2",
        "task=digits",
        "task.model.hidden=16",
        "task.data.batch_size=32",
    ],
    "dcp_flat": [
        "strategy=pipeline",
        "trainer.devices=2",
        "experiment=gpt_tiny",
        "task.model.n_embd=16",
        "task.model.block_size=32",
        "task.scheduler.name=constant",
        "trainer.val_check_interval=20",
    ],
}


@pytest.mark.parametrize("layout", sorted(CASES))
def test_a_checkpoint_from_the_older_layout_resumes_exactly(layout, workdir):
    shutil.copytree(FIXTURES / layout, workdir / "run", symlinks=True)
    old_rows = metric_rows(workdir / "run")
    assert [s for s, _ in old_rows] == list(range(10))
    resumed = fw("train", *CASES[layout], *COMMON, "run.dir=run", cwd=workdir)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Resuming from" in resumed.stderr and "(step 10)" in resumed.stderr
    fresh = fw("train", *CASES[layout], *COMMON, "run.dir=fresh", cwd=workdir)
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    got, want = metric_rows(workdir / "run"), metric_rows(workdir / "fresh")
    assert [s for s, _ in got] == list(range(20)), "each step exactly once"
    assert got[:10] == old_rows, "the first ten steps are the old run's rows"
    for (step, a), (_, b) in zip(got, want, strict=True):
        assert abs(float(a) - float(b)) <= 1e-5, (step, a, b)
