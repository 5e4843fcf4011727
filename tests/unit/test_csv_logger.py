"""metrics.csv: one row per step, new columns added, values kept."""

from __future__ import annotations

import csv

from framework.loggers.csv.logger import StepCSVLogger


def rows(path):
    with path.open(newline="") as fh:
        return list(csv.DictReader(fh))


def test_metrics_of_one_step_share_one_row(tmp_path):
    path = tmp_path / "metrics.csv"
    logger = StepCSVLogger(path)
    logger.log_metrics({"train/loss": 2.0}, step=0)
    logger.save()
    logger.log_metrics({"train/loss": 1.5}, step=9)
    logger.save()
    logger.log_metrics({"val/loss": 1.7, "val/acc": 0.5}, step=9)
    logger.save()
    logger.log_metrics({"train/loss": 1.0}, step=19)
    logger.finalize("success")
    got = rows(path)
    assert [r["step"] for r in got] == ["0", "9", "19"]
    assert got[1] == {"step": "9", "train/loss": "1.5", "val/acc": "0.5", "val/loss": "1.7"}
    assert got[0]["val/loss"] == ""


def test_file_exists_with_a_header_before_any_metric(tmp_path):
    StepCSVLogger(tmp_path / "metrics.csv")
    assert (tmp_path / "metrics.csv").read_text().strip() == "step"


def test_resume_keeps_earlier_steps_and_merges_into_the_last_one(tmp_path):
    path = tmp_path / "metrics.csv"
    first = StepCSVLogger(path)
    for step in range(6):
        first.log_metrics({"train/loss": float(step)}, step=step)
        first.save()
    # the job died after step 5; its last checkpoint is at step 4 (steps 0-3 complete)
    second = StepCSVLogger(path, resume_step=4)
    second.log_metrics({"val/loss": 9.0}, step=3)
    second.save()
    for step in range(4, 7):
        second.log_metrics({"train/loss": 10.0 + step}, step=step)
        second.save()
    got = rows(path)
    assert [int(r["step"]) for r in got] == [0, 1, 2, 3, 4, 5, 6]
    assert got[3]["train/loss"] == "3.0" and got[3]["val/loss"] == "9.0"
    assert got[5]["train/loss"] == "15.0"
