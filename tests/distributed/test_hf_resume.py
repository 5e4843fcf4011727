"""Runs of a transformers model survive: a plain LightningModule holding a Llama, killed with
kill -9 under fsdp_tp (fsdp=2 x tp=2, 4 processes) and started again, resumes from its last
checkpoint and continues bitwise as the uninterrupted run; a checkpoint written under tensor=2
moves to fsdp=2 and continues on the trajectory of the run that never moved (1e-5)."""

from __future__ import annotations

import os
import shutil
import signal
import time

import pytest
import torch
import transformers  # noqa: F401 (the hf extra: missing, these fail, not skip)

from framework.checkpoint import disk
from framework.checkpoint.export import consolidated_state
from tests.conftest import QUIET, assert_resumed, fw, losses, metric_rows
from tests.distributed.test_resume import start, wait_for_step
from tests.hf_pretrained import LOGITS, PLAIN, shared_runs
from tests.hf_tasks import PlainLlama

pytestmark = pytest.mark.slow

STEPS, EVERY = 8, 3
FSDP_TP = [
    *PLAIN,
    f"task._target_={__name__}.SlowLlama",
    "strategy=fsdp_tp",
    "trainer.devices=4",
    "task.data.batch_size=4",
    "trainer.deterministic=true",
    f"trainer.max_steps={STEPS}",
    f"callbacks.checkpoint.every_n_steps={EVERY}",
    *QUIET,
]


class SlowLlama(PlainLlama):
    """PlainLlama whose steps take 0.2 s more, so a test can kill it mid-run."""

    def training_step(self, batch, batch_idx):
        time.sleep(0.2)
        return super().training_step(batch, batch_idx)


def final_weights(run) -> dict[str, torch.Tensor]:
    return consolidated_state(disk.resolve(run, "run"))


def test_kill_9_under_fsdp_tp_resumes_bitwise(tmp_path):
    reference = fw("train", *FSDP_TP, "run.dir=reference", cwd=tmp_path)
    assert reference.returncode == 0, reference.stderr[-3000:]
    run = tmp_path / "run"
    proc = start([*FSDP_TP, f"run.dir={run}"], tmp_path)
    try:
        wait_for_step(run, EVERY + 1, proc, timeout=300)  # past the checkpoint of step 3
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    killed_at = max(s for s, _ in metric_rows(run))
    assert killed_at < STEPS - 1, "killed before the end"
    again = fw("train", *FSDP_TP, f"run.dir={run}", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    resumed = int(again.stderr.split("Resuming from ")[1].split("(step ")[1].split(")")[0])
    assert resumed % EVERY == 0 and 0 < resumed <= killed_at, (resumed, killed_at)
    assert_resumed(again.stderr, run, STEPS)  # each step logged once: the steps after 3 again
    want = metric_rows(tmp_path / "reference")
    assert metric_rows(run) == want, "losses after the restart are bitwise the uninterrupted run's"
    a, b = final_weights(run), final_weights(tmp_path / "reference")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_tensor_parallel_checkpoint_moves_to_fsdp(tmp_path_factory, tmp_path):
    """tensor=2's checkpoint of step 3 continues under fsdp=2 to step 6 as the fsdp=2 run that
    trained all 6 steps (test_hf_export.py's runs, the same global batch of 8)."""
    runs = shared_runs(tmp_path_factory, ["tensor", "fsdp"])
    run = tmp_path / "run"
    shutil.copytree(runs["tensor"], run, symlinks=True)
    args = [*PLAIN, "strategy=fsdp", "trainer.devices=2", "task.data.batch_size=4"]
    args += ["task._target_=tests.hf_tasks.PlainLlama", "trainer.max_steps=6", LOGITS]
    moved = fw("train", *args, f"run.dir={run}", cwd=tmp_path)
    assert moved.returncode == 0, moved.stderr[-3000:]
    # the same format and process count: read by slices as it is (no move to log)
    assert "changed settings: strategy.fsdp: 1 -> -1; strategy.tp: -1 -> 1" in moved.stderr
    assert "step00000003 (step 3)" in moved.stderr, moved.stderr[-3000:]
    assert_resumed(moved.stderr, run, 6)
    got, want = losses(run), losses(runs["fsdp"])
    assert sorted(got) == sorted(want) == list(range(6))
    assert all(abs(got[s] - want[s]) <= 1e-5 for s in want), (got, want)
    # AdamW's first steps move a weight by about lr (1e-3) whatever its gradient's size: the
    # rounding-level differences of another layout show at up to 2e-5 after 6 steps
    a, b = final_weights(run), final_weights(runs["fsdp"])
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-4) for k in a)
