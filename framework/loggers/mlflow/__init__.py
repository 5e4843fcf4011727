"""`logger=[csv,mlflow]`: an MLflow run per job, followed across restarts and evaluations.

Lightning's MLFlowLogger on rank 0. Without `tracking_uri` (or $MLFLOW_TRACKING_URI) the runs
are stored in the SQLite file RUN_DIR/mlflow.db (`mlflow ui --backend-store-uri
sqlite:///RUN_DIR/mlflow.db`; MLflow no longer takes plain folders). The MLflow run
carries the tag `fw_run_id` (the run id in run.json): a resumed job, `fw test` and `fw validate`
find that run again and log to it. Needs the `mlflow-skinny` package (`pip install
'framework[mlflow]'`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from framework.config.fields import doc
from framework.errors import ConfigError
from framework.loggers import installed


@dataclass
class Config:
    """MLflow experiment tracking."""

    kind: str = doc("mlflow", "Logger plugin.")
    tracking_uri: str | None = doc(
        None, "MLflow server or store (None: $MLFLOW_TRACKING_URI, else RUN_DIR/mlflow.db)."
    )
    experiment: str = doc("framework", "MLflow experiment name.")
    run_name: str | None = doc(None, "Display name (None: run.name, else the run directory's).")
    tags: dict[str, str] = doc({}, "Tags of the MLflow run.")


def validate(cfg: Config, world) -> None:
    if not installed("mlflow"):
        raise ConfigError(
            "logger.mlflow",
            cfg.kind,
            "the mlflow package is not installed",
            hint="Install it with `pip install 'framework[mlflow]'`, or drop it: logger=[csv].",
        )


def tracking_uri(cfg: Config, run_dir) -> str:
    """Where the MLflow runs go: the config's, the environment's, else the run directory."""
    from pathlib import Path

    found = cfg.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    return found or f"sqlite:///{(Path(run_dir) / 'mlflow.db').resolve()}"


def build(cfg: Config, ctx):
    from framework.loggers.mlflow.logger import make_logger

    return make_logger(cfg, ctx, tracking_uri(cfg, ctx.run_dir))
