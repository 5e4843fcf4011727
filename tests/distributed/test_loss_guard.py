"""callbacks.loss_guard end to end: a NaN or a spiking loss at chosen steps is skipped or rolled
back on every rank, and training goes on exactly as a run whose data leaves those samples out;
`stop` ends the job naming the step.

Every guarded run trains digits in a fixed order, 32 samples a step (2 ranks x 16), for 12
steps, and leaves out the batches of steps 4, 5 and 6 (samples 128-223): `skip` by three bad
steps (NaN, spike, NaN), `rollback` by one NaN at step 6 that rolls back to the checkpoint of
step 4. The one reference is a one-process run without those samples: its steps 0-3 are the
guarded steps 0-3, its steps 4-8 the guarded steps 7-11, learning rates included."""

from __future__ import annotations

import json

import pytest

from tests.conftest import QUIET, fw, losses

pytestmark = pytest.mark.slow
LEFT_OUT = list(range(128, 224))  # the samples of steps 4-6 (32 a step, in order)
BASE = [
    *QUIET,
    "task=digits",
    "task._target_=tests.loss_guard_tasks.BadStepDigits",
    "task.data._target_=tests.loss_guard_tasks.OrderedDigits",
    "~task.data.val_fraction",
    "task.model.hidden=16",
    "trainer.deterministic=true",
    "trainer.log_every_n_steps=1",
    "logger=[csv]",
    # a schedule that moves every step: a skipped step must not advance it, a rollback restores it
    "task.scheduler.name=cosine",
    "task.scheduler.warmup_steps=5",
]
GUARDED = [
    *BASE,
    "task.data.batch_size=16",
    "trainer.devices=2",
    "trainer.max_steps=12",
    "+callbacks.loss_guard.kind=loss_guard",
    "+callbacks.loss_guard.warmup=3",
    "+callbacks.loss_guard.window=4",
    "+callbacks.loss_guard.z=3",
]
BAD_STEPS = ["+task.model.nan_steps=[4,6]", "+task.model.spike_steps=[5]"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Losses of the one-process run without the samples of steps 4-6."""
    root = tmp_path_factory.mktemp("loss_guard_reference")
    leave_out = "[" + ",".join(map(str, LEFT_OUT)) + "]"
    args = [*BASE, "task.data.batch_size=32", f"+task.data.leave_out={leave_out}"]
    # 12 steps (3 more than compared), so that its cosine schedule has the guarded runs' length
    result = fw("train", *args, "trainer.max_steps=12", "run.dir=run", cwd=root)
    assert result.returncode == 0, result.stderr[-3000:]
    return losses(root / "run")


def guarded(workdir, *args: str) -> tuple[dict[int, float], list[dict]]:
    result = fw("train", *GUARDED, *args, "run.dir=run", cwd=workdir)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = (workdir / "run" / "skipped.jsonl").read_text().splitlines()
    return losses(workdir / "run"), [json.loads(line) for line in lines]


def assert_continues_as_reference(got: dict[int, float], reference: dict[int, float]) -> None:
    assert sorted(got) == list(range(12)), "every step logged once"
    for step in (*range(4), *range(7, 12)):
        want = reference[step if step < 4 else step - 3]
        assert got[step] == pytest.approx(want, abs=1e-5), f"step {step}"


def test_rollback_reloads_the_checkpoint_and_skips_the_batches_since(workdir, reference):
    got, records = guarded(
        workdir,
        "+task.model.nan_steps=[6]",
        "+task.model.bad_rank=1",
        "+callbacks.loss_guard.action=rollback",
        "callbacks.checkpoint.every_n_steps=4",
    )
    assert [(r["step"], r["action"], r["rolled_back_to"]) for r in records] == [(6, "rollback", 4)]
    assert records[0]["skipped_steps"] == [4, 5, 6]
    assert records[0]["sample_ids"] == LEFT_OUT
    assert_continues_as_reference(got, reference)


@pytest.mark.parametrize(
    "layout",
    [
        ["strategy=fsdp"],
        ["strategy=zero2"],
        ["strategy=pipeline", "task.data.batch_size=32"],  # 2 stages: one data rank
    ],
    ids=["fsdp", "zero2", "pipeline"],
)
def test_skip_drops_nan_and_spike_steps_on_every_rank(workdir, reference, layout):
    """Rank 1 alone goes bad (under the pipeline: the last stage, which alone computes the
    loss): the ranks still agree, and each bad batch is skipped, under FSDP's shards,
    DeepSpeed's own gradient buffers and a pipeline. (Plain ddp: its rollback below, and the
    kill campaign's nan trial in test_recovery.py.)"""
    got, records = guarded(workdir, *BAD_STEPS, "+task.model.bad_rank=1", *layout)
    assert [(r["step"], r["action"]) for r in records] == [(4, "skip"), (5, "skip"), (6, "skip")]
    assert [r["reason"].split(" (")[0] for r in records] == [
        "non-finite loss",
        "loss spike",
        "non-finite loss",
    ]
    assert sum((r["sample_ids"] for r in records), []) == LEFT_OUT
    assert_continues_as_reference(got, reference)


def test_stop_exits_non_zero_naming_the_step_and_saves_nothing_after(workdir):
    args = [
        "+task.model.nan_steps=[3]",
        "+callbacks.loss_guard.action=stop",
        "callbacks.checkpoint.every_n_steps=2",
        "trainer.max_steps=6",
        "run.dir=run",
    ]
    result = fw("train", *GUARDED, *args, cwd=workdir)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "callbacks.loss_guard: non-finite loss at step 3 (epoch 0, batch 3)" in result.stderr
    saved = sorted(p.name for p in (workdir / "run" / "checkpoints").glob("step*"))
    assert saved == ["step00000002"], "no checkpoint of the bad step or after it"
