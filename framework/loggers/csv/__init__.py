"""`logger=csv`: metrics.csv in the run directory, one row per logged step.

Lightning's CSVLogger writes one row per `log_metrics` call, so a step that logs training and
validation metrics gets two rows. This logger merges everything logged at one step into one row,
rewrites the header when a new metric appears, and only ever runs on rank 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from framework.config.fields import doc


@dataclass
class Config:
    """Metrics as CSV in the run directory."""

    kind: str = doc("csv", "Logger plugin.")
    filename: str = doc("metrics.csv", "File name inside the run directory.")


def validate(cfg: Config, world) -> None:
    """Nothing to check before launch."""


def metrics_file(cfg: Config) -> str:
    """The rows `fw sweep` reads a trial's metric from."""
    return cfg.filename


def build(cfg: Config, ctx):
    if ctx.command != "fit":
        return None  # metrics.csv holds training's rows; an evaluation writes <command>.csv
    from framework.loggers.csv.logger import StepCSVLogger

    return StepCSVLogger(
        Path(ctx.run_dir) / cfg.filename, name=ctx.run_name, resume_step=ctx.resume_step
    )
