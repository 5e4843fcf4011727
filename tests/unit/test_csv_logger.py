"""metrics.csv: one row per step, new columns added, values kept."""

from __future__ import annotations

import csv

from framework.loggers._step_csv import StepCSVLogger


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
