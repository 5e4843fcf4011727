"""What a Lightning user reaches for, through `fw` as they would type it: loggers by class and
by kind, Trainer arguments the framework does not own, test after fit with the `best` link,
one progress bar counted in steps, and the refusals a run would otherwise discover late."""

from __future__ import annotations

import sqlite3

import pytest

from framework import predictions
from framework.checkpoint import disk
from framework.runtime.evaluation import read_results
from tests.conftest import QUIET, fw, read_metrics

pytestmark = pytest.mark.slow
DIGITS = ["task=digits", "task.data.batch_size=32", "logger=[csv]", *QUIET]


def train(*args: str, cwd, code: int = 0):
    result = fw("train", *args, cwd=cwd)
    assert result.returncode == code, result.stderr[-3000:]
    return result


def mlflow_metrics(db) -> dict[str, float]:
    """Each metric's latest value across the runs of an MLflow SQLite store."""
    with sqlite3.connect(db) as con:
        return dict(con.execute("select key, value from latest_metrics").fetchall())


def test_loggers_by_class_and_by_kind_write_their_files_and_follow_the_run(workdir):
    """TensorBoard and MLflow by `_target_` and as kinds; `fw test` of the run, the classes
    named again, logs to the same MLflow run (found again by its tag) and leaves training's
    files as they were."""
    run = workdir / "run"
    targets = [
        "+logger.tb._target_=lightning.pytorch.loggers.TensorBoardLogger",
        "+logger.ml._target_=lightning.pytorch.loggers.MLFlowLogger",
        f"+logger.ml.tracking_uri=sqlite:///{workdir / 'own.db'}",
    ]
    kinds = ["logger=[csv,tensorboard,mlflow]"]
    args = [*DIGITS, *kinds, *targets, "trainer.max_steps=3", "trainer.log_every_n_steps=1"]
    train(*args, f"run.dir={run}", cwd=workdir)
    assert list((run / "tensorboard").glob("events.out.tfevents.*")), "the tensorboard kind"
    assert list((run / "tb").rglob("events.out.tfevents.*")), "TensorBoardLogger by class"
    assert "train/loss" in mlflow_metrics(run / "mlflow.db"), "the mlflow kind"
    assert "train/loss" in mlflow_metrics(workdir / "own.db"), "MLFlowLogger by class"
    runs_before = sqlite3.connect(run / "mlflow.db").execute("select count(*) from runs").fetchone()
    # the classes by name again: a run's config builds only classes your own command line or
    # config groups name (its config.yaml could be anyone's); --trust would take them as saved
    refused = fw("test", str(run), cwd=workdir)
    assert refused.returncode == 2 and "logger.tb._target_=" in refused.stderr, refused.stderr
    named = [t.lstrip("+") for t in targets if "._target_=" in t]
    result = fw("test", str(run), *named, cwd=workdir)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "test/acc" in result.stdout and read_results(run, "test")
    assert "test/loss" in mlflow_metrics(run / "mlflow.db")
    runs_after = sqlite3.connect(run / "mlflow.db").execute("select count(*) from runs").fetchone()
    assert runs_after == runs_before, "the evaluation logs to the training's MLflow run"


def test_a_misspelt_logger_class_is_refused_before_anything_is_written(workdir):
    args = ["+logger.tb._target_=lightning.pytorch.loggers.TensorBordLogger", "run.dir=run"]
    result = train(*DIGITS, *args, cwd=workdir, code=2)
    assert "logger.tb._target_=lightning.pytorch.loggers.TensorBordLogger" in result.stderr
    assert "TensorBoardLogger" in result.stderr and "Traceback" not in result.stderr
    assert list(workdir.iterdir()) == []


def test_max_time_stops_the_run_and_leaves_a_resumable_checkpoint(workdir):
    slow = ["task._target_=tests.tasks.SlowDigitsTask", "+task.model.step_sleep=0.2"]
    args = [*DIGITS, *slow, "trainer.max_steps=1000", "trainer.log_every_n_steps=1", "run.dir=run"]
    train(*args, "trainer.max_time=00:00:00:04", cwd=workdir)
    stopped = [int(r["step"]) for r in read_metrics(workdir / "run") if r.get("train/loss")]
    saved = sorted((workdir / "run" / "checkpoints").glob("step*"))
    assert saved and 0 < stopped[-1] < 999, stopped
    step = int(saved[-1].name.removeprefix("step"))
    assert step >= stopped[-1], "the checkpoint holds the step the timer stopped at"
    resumed = train(*args, f"trainer.max_steps={step + 2}", cwd=workdir)
    assert f"Resuming from {saved[-1]}" in resumed.stderr


def test_fast_dev_run_true_runs_one_batch_and_keeps_nothing(workdir):
    """Also the last line's note: the digits data has a test split, this task no test_step."""
    plain = ["task._target_=tests.tasks.PlainDigits", "~task.model.dropout", "~task.model.hidden"]
    args = [*DIGITS, *plain, "trainer.fast_dev_run=true", "run.dir=run"]
    result = train(*args, cwd=workdir)
    assert "Run finished at step 1" in result.stderr
    assert "DigitsDataModule has a test_dataloader but PlainDigits defines no test_step" in (
        result.stderr
    )
    assert not list((workdir / "run" / "checkpoints").glob("step*")), "no checkpoint"


def test_fw_predict_on_the_gpt_recipe_samples_text(workdir):
    tiny = ["experiment=gpt_tiny", "logger=[csv]", *QUIET, "task.model.sample_length=8"]
    result = train(*tiny, "trainer.max_steps=2", "run.dir=run", cwd=workdir)
    assert "test it with fw test" in result.stderr
    prompts = ["+task.data.prompts=['def main(','import ']"]
    out = fw("predict", "run", *prompts, *QUIET, cwd=workdir)
    assert out.returncode == 0, out.stderr[-3000:]
    texts = predictions.read(workdir / "run")
    assert len(texts) == 2 and texts[0].startswith("def main(") and texts[1].startswith("import ")
    assert all(
        len(t.encode()) >= len(p) + 8 for t, p in zip(texts, ["def main(", "import "], strict=True)
    )


def test_test_after_fit_tests_the_best_checkpoint(workdir):
    """The best by the monitor is not the newest here (mode=max on a falling loss: the first):
    `checkpoints/best` points at it and the test after fit reads it."""
    ckpt = ["callbacks.checkpoint.monitor=val/loss", "callbacks.checkpoint.mode=max"]
    args = [*DIGITS, *ckpt, "trainer.max_steps=6", "trainer.val_check_interval=2"]
    train(*args, "trainer.test_after_fit=true", "run.dir=run", cwd=workdir)
    checkpoints = workdir / "run" / "checkpoints"
    best = (checkpoints / "best").resolve()
    losses = [float(r["val/loss"]) for r in read_metrics(workdir / "run") if r.get("val/loss")]
    assert best.name == "step00000002" and (checkpoints / "step00000006").is_dir()
    assert disk.read_meta(best)["metrics"]["val/loss"] == pytest.approx(max(losses)), losses
    (row,) = read_results(workdir / "run", "test")
    assert row["checkpoint"] == "step00000002" and float(row["test/loss"]) > 0


def test_a_monitor_no_part_of_the_task_logs_stops_at_the_first_validation(workdir):
    args = [*DIGITS, "trainer.max_steps=6", "trainer.val_check_interval=2"]
    result = train(
        *args, "callbacks.checkpoint.monitor=val/los", "run.dir=run", cwd=workdir, code=2
    )
    assert "callbacks.checkpoint.monitor=val/los: no part of the task logs" in result.stderr
    assert "val/loss" in result.stderr  # what it does log


def test_the_progress_bar_counts_the_steps_of_the_run(workdir):
    """One bar for the run in optimizer steps: 3/3, then resumed with accumulation 3/6 to 6/6
    (Lightning's bars showed the batches of each epoch: `Epoch 0/-2`, `20/9`, `20/10`)."""
    bar = ["trainer.enable_progress_bar=true", "run.dir=run"]
    first = train(*DIGITS, *bar, "trainer.max_steps=3", cwd=workdir).stdout
    assert "Steps: 100%" in first and "3/3" in first, first[-500:]
    more = ["trainer.max_steps=6", "trainer.accumulate_grad_batches=2"]
    second = train(*DIGITS, *bar, *more, cwd=workdir).stdout
    assert "6/6" in second and "Epoch" not in second, second[-500:]
    assert not any(f"/{n}" in second for n in (7, 9, 10, 12, -1, -2)), second[-800:]
