"""callbacks.loss_guard in one process: the spike test's arithmetic, what a dropped step leaves
unchanged, and the settings refused before launch (the runs are in
tests/distributed/test_loss_guard.py)."""

from __future__ import annotations

import math
import statistics
from types import SimpleNamespace

import pytest
import torch

from framework.callbacks.loss_guard import Config
from framework.callbacks.loss_guard.callback import LossGuard, SpikeWindow, judge
from tests.conftest import refused


def test_a_spike_is_a_loss_above_mean_plus_z_sample_std_of_the_window():
    window = SpikeWindow(z=2.0, window=4, warmup=3)
    for loss in (9.0, 1.0, 2.0, 3.0, 4.0):  # the window keeps the last 4: 1, 2, 3, 4
        window.add(loss)
    limit = statistics.fmean([1, 2, 3, 4]) + 2.0 * statistics.stdev([1, 2, 3, 4])
    assert window.threshold() == pytest.approx(limit)  # 2.5 + 2 x 1.29
    assert judge(limit - 1e-6, True, window) is None
    assert judge(limit + 1e-6, True, window).startswith("loss spike")


def test_no_spike_is_looked_for_during_warmup_but_nan_always_is():
    window = SpikeWindow(z=1.0, window=10, warmup=3)
    window.add(1.0)
    window.add(1.0)
    assert window.threshold() is None, "2 good losses seen, warmup 3"
    assert judge(1000.0, True, window) is None
    assert judge(math.nan, True, window) == "non-finite loss"
    assert judge(math.inf, True, window) == "non-finite loss"
    assert judge(1.0, False, window) == "non-finite gradient norm"
    window.add(1.0)
    assert judge(1.0 + 1e-9, True, window).startswith("loss spike"), "std 0: above the mean"


def test_a_dropped_step_changes_nothing_and_the_schedule_holds_still():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (step + 1))
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.randn(3, 4)).sum().backward()
    guard = LossGuard(Config(), SimpleNamespace(run_dir=".", data_parallel=(0, 1)))
    guard.drop_gradients(opt)
    guard.hold_schedules(
        SimpleNamespace(lr_scheduler_configs=[SimpleNamespace(interval="step", scheduler=schedule)])
    )
    opt.step()
    schedule.step()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True)), (
        "no update"
    )
    assert opt.state_dict()["state"] == {}, "no momentum, no step count"
    assert opt.param_groups[0]["lr"] == 0.1 and schedule.last_epoch == 0, "schedule held"
    guard.release_schedules()
    schedule.step()
    assert schedule.last_epoch == 1 and opt.param_groups[0]["lr"] == pytest.approx(0.05)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("action=retry", "callbacks.loss_guard.action=retry: not a valid choice"),
        ("z=0", "callbacks.loss_guard.z=0.0: must be greater than 0.0"),
        ("window=1", "callbacks.loss_guard.window=1: must be at least 2"),
    ],
)
def test_bad_settings_exit_2_before_anything_starts(
    override, message, workdir, monkeypatch, capsys
):
    args = [
        "task=digits",
        "+callbacks.loss_guard.kind=loss_guard",
        f"+callbacks.loss_guard.{override}",
    ]
    err = refused(args, workdir, monkeypatch, capsys)
    assert message in err


def guarded_under_a_loss_scaler(workdir, monkeypatch, *args: str) -> tuple[int, list, dict]:
    """`fw train` of digits in this process with the loss guard and fp16's loss scaler on the CPU
    (tests.tasks.CpuGradScaler): its exit code, skipped.jsonl's records, the scales per step."""
    import json

    from framework.cli import main

    monkeypatch.chdir(workdir)
    code = main(
        [
            "train",
            "task=digits",
            "task._target_=tests.loss_guard_tasks.BadStepDigits",
            "trainer.limit_val_batches=0",
            "+callbacks.loss_guard.kind=loss_guard",
            "+callbacks.fp16._target_=tests.tasks.CpuGradScaler",
            "trainer.enable_progress_bar=false",
            "trainer.enable_model_summary=false",
            "run.dir=run",
            *args,
        ]
    )
    skipped = workdir / "run" / "skipped.jsonl"
    records = (
        [json.loads(line) for line in skipped.read_text().splitlines()] if skipped.exists() else []
    )
    scales_file = workdir / "run" / "scales-rank0.json"
    scales = json.loads(scales_file.read_text())["scales"] if scales_file.exists() else []
    return code, records, {step: (before, after) for step, before, after in scales}


@pytest.mark.slow
def test_routine_fp16_overflows_are_left_to_the_loss_scaler(workdir, monkeypatch):
    """fp16 autocast with a scale too large at first and a growth probe every 3 steps: the
    scaler overflows and skips steps as it should, and `action=stop` does not stop the run."""
    code, records, scales = guarded_under_a_loss_scaler(
        workdir,
        monkeypatch,
        "trainer.max_steps=12",
        "+callbacks.loss_guard.action=stop",
        "+callbacks.fp16.init_scale=16777216.0",  # 2**24: fp16 gradients overflow
        "+callbacks.fp16.growth_interval=3",
    )
    assert code == 0
    assert records == []
    overflowed = [step for step, (before, after) in scales.items() if after < before]
    assert len(overflowed) >= 2, scales  # the first steps, and at least one growth probe
    assert sorted(scales) == list(range(12))


@pytest.mark.slow
def test_a_bad_loss_and_overflows_below_scale_one_are_bad_steps_under_the_scaler(
    workdir, monkeypatch
):
    """Under the scaler alone (fp32) with an inf planted in the gradients from step 4 on and a
    NaN loss at step 2: the NaN is a bad step; the overflows at scales 8, 4, 2 and 1 are the
    scaler's; from scale 0.5 on (step 8) the gradients are not finite at any scale: bad."""
    code, records, scales = guarded_under_a_loss_scaler(
        workdir,
        monkeypatch,
        "trainer.max_steps=12",
        "+task.model.nan_steps=[2]",
        "+callbacks.loss_guard.action=skip",
        "+callbacks.fp16.init_scale=16.0",
        "+callbacks.fp16.autocast=false",
        "+callbacks.fp16.overflow_steps=[4,5,6,7,8,9,10,11]",
    )
    assert code == 0
    assert [r["step"] for r in records] == [2, 8, 9, 10, 11], records
    assert records[0]["reason"] == "non-finite loss"
    assert records[1]["reason"] == "non-finite gradients at every loss scale down to 0.5"
    assert [scales[s][0] for s in range(4, 9)] == [8.0, 4.0, 2.0, 1.0, 0.5]
