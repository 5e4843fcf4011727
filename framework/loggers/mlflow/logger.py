"""The MLflow logger behind `logger=mlflow` (imports mlflow and Lightning: loaded in workers)."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.loggers import MLFlowLogger
from lightning.pytorch.utilities import rank_zero_only

TAG = "fw_run_id"  # the MLflow run's tag holding the framework's run id (run.json)


def existing_run(uri: str, experiment: str, run_id: str) -> str | None:
    """The id of the MLflow run an earlier start of this run created, or None."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    found = client.get_experiment_by_name(experiment)
    if found is None:
        return None
    runs = client.search_runs([found.experiment_id], filter_string=f"tags.{TAG} = '{run_id}'")
    return runs[0].info.run_id if runs else None


def make_logger(cfg: Any, ctx: Any, uri: str) -> MLFlowLogger:
    """Lightning's MLFlowLogger for this run: the MLflow run of an earlier start when there is
    one (looked up on rank 0; the other ranks never write)."""
    previous = existing_run(uri, cfg.experiment, ctx.run_id) if rank_zero_only.rank == 0 else None
    return MLFlowLogger(
        experiment_name=cfg.experiment,
        run_name=cfg.run_name or ctx.run_name,
        tracking_uri=uri,
        tags={**dict(cfg.tags), TAG: ctx.run_id},
        run_id=previous,
    )
