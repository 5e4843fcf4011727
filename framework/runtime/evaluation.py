"""The worker's side of `fw validate|test|predict` and `trainer.test_after_fit`: Lightning's own
`Trainer.validate/test/predict` on the task, from a checkpoint of any layout, with what they
leave behind.

The checkpoint is read as a resume reads it (`ckpt_path` -> the strategy's `load_checkpoint`,
framework/strategy_base.py: this rank's slices only; with no optimizers, only the model). Two
callbacks record the results on rank 0:

- `EvaluationRecord`: one row per evaluation in RUN_DIR/validate.csv or test.csv (when, which
  checkpoint and step, how many processes under which layout, every metric the task logged),
  beside metrics.csv; the loggers get the same metrics through Lightning (W&B: the run's summary,
  same run id);
- `PredictionWriter`: each rank's `predict_step` outputs with the dataset index of every sample,
  in RUN_DIR/predictions/rankNNNNN.pt; `framework.predictions.read` puts them back in the
  dataset's order, whatever the process count.
"""

from __future__ import annotations

import contextlib
import csv
import inspect
import io
import logging
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import BasePredictionWriter

from framework import files

log = logging.getLogger("framework.evaluation")

PREDICTIONS = "predictions"  # the folder in the run directory
FIXED_COLUMNS = ("time", "checkpoint", "step", "processes", "strategy")


def results_file(run_dir: Path, command: str) -> Path:
    """Where an evaluation command's rows go: RUN_DIR/validate.csv or RUN_DIR/test.csv."""
    return Path(run_dir) / f"{command}.csv"


def read_results(run_dir: Path, command: str) -> list[dict[str, str]]:
    """The rows of RUN_DIR/<command>.csv, oldest first ([] when there are none)."""
    path = results_file(run_dir, command)
    if not path.is_file():
        return []
    with path.open(newline="") as fh:
        return list(csv.DictReader(fh))


def append_row(path: Path, row: dict[str, Any]) -> None:
    """Add one row to a CSV file whose columns may grow (rewritten whole, atomically)."""
    rows = read_results(path.parent, path.stem)
    columns = list(FIXED_COLUMNS)
    for record in [*rows, row]:
        columns += [k for k in record if k not in columns]
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=columns)
    writer.writeheader()
    writer.writerows([*rows, row])
    files.write_atomic(path, text.getvalue())


def scalars(metrics: dict[str, Any]) -> dict[str, float]:
    return {
        k: float(v)
        for k, v in metrics.items()
        if isinstance(v, (int, float, torch.Tensor)) and torch.as_tensor(v).numel() == 1
    }


class EvaluationRecord(pl.Callback):
    """Appends each standalone validation and each test to RUN_DIR/<command>.csv on rank 0
    (a validation inside fit is training's, in metrics.csv)."""

    def __init__(self, run_dir: Path, checkpoint: Path | None, step: int, layout: str) -> None:
        self.run_dir, self.checkpoint, self.step, self.layout = run_dir, checkpoint, step, layout

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn == "validate":
            self.record(trainer, "validate")

    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.record(trainer, "test")

    def record(self, trainer: pl.Trainer, command: str) -> None:
        if not trainer.is_global_zero:
            return
        row = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "checkpoint": self.checkpoint.name if self.checkpoint else "",
            "step": self.step,
            "processes": trainer.world_size,
            "strategy": self.layout,
            **scalars(trainer.callback_metrics),
        }
        append_row(results_file(self.run_dir, command), row)


class PredictionWriter(BasePredictionWriter):
    """Each rank's predict_step outputs, with the dataset index of each sample (Lightning
    records the indices its sampler gave every batch), written to
    RUN_DIR/predictions/rankNNNNN.pt when prediction ends."""

    def __init__(self, run_dir: Path) -> None:
        super().__init__(write_interval="batch")
        self.folder = Path(run_dir) / PREDICTIONS
        self.indices: list[list[int]] = []
        self.outputs: list[Any] = []

    def write_on_batch_end(
        self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx
    ) -> None:
        self.indices.append([int(i) for i in batch_indices])
        self.outputs.append(on_cpu(prediction))

    def on_predict_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        data = {"indices": self.indices, "outputs": self.outputs}
        path = self.folder / f"rank{trainer.global_rank:05d}.pt"
        files.write_atomic_with(path, lambda fh: torch.save(data, fh))


@contextlib.contextmanager
def loaders_by_keyword(source: Any, hook: str):
    """While it runs, `source.<hook>()`'s DataLoaders are rebuilt by Lightning from keyword
    arguments only. To predict, Lightning builds each loader again with a batch sampler that
    records the indices and passes `batch_size=1` beside the arguments the loader was first
    given; one given positionally (`DataLoader(dataset, 8)`) then reaches `__init__` twice and
    Lightning stops the run. The positional arguments Lightning recorded are turned into the
    keywords they bind to (where each has a name: not a subclass's `*args`)."""
    from lightning.pytorch.utilities.model_helpers import is_overridden

    parent = pl.LightningDataModule if isinstance(source, pl.LightningDataModule) else None
    if not is_overridden(hook, source, parent or pl.LightningModule):
        yield
        return
    original, own = getattr(source, hook), vars(source).get(hook)  # own: set on the instance

    def by_keyword() -> Any:
        loaders = original()
        for loader in loaders.values() if isinstance(loaders, dict) else _as_list(loaders):
            _positional_to_keywords(loader)
        return loaders

    setattr(source, hook, by_keyword)
    try:
        yield
    finally:
        if own is None:
            delattr(source, hook)
        else:
            setattr(source, hook, own)


def _as_list(loaders: Any) -> list:
    return list(loaders) if isinstance(loaders, (list, tuple)) else [loaders]


def _positional_to_keywords(loader: Any) -> None:
    args = getattr(loader, "__pl_saved_args", ())
    names = getattr(loader, "__pl_saved_arg_names", ())
    if not args or len(names) != len(args):
        return
    params = inspect.signature(type(loader).__init__).parameters
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    if any(name not in params or params[name].kind not in kinds for name in names):
        return
    kwargs = {**dict(zip(names, args, strict=True)), **loader.__pl_saved_kwargs}
    object.__setattr__(loader, "__pl_saved_kwargs", kwargs)
    object.__setattr__(loader, "__pl_saved_args", ())
    object.__setattr__(loader, "__pl_saved_arg_names", ())


def on_cpu(value: Any) -> Any:
    """A prediction as plain CPU data: tensors (a DTensor whole) on the CPU, containers kept."""
    if isinstance(value, torch.Tensor):
        if hasattr(value, "full_tensor"):
            value = value.full_tensor()
        return value.detach().cpu()
    if isinstance(value, (list, tuple)):
        return type(value)(on_cpu(v) for v in value)
    if isinstance(value, dict):
        return {k: on_cpu(v) for k, v in value.items()}
    return value


def run(trainer: pl.Trainer, task: Any, data: Any, command: str, ckpt_path: str | None) -> None:
    """Lightning's Trainer.validate/test/predict of the task on its data, from `ckpt_path`."""
    if command == "predict":
        with loaders_by_keyword(data if data is not None else task, "predict_dataloader"):
            trainer.predict(
                task,
                datamodule=data,
                ckpt_path=ckpt_path,
                return_predictions=False,
                weights_only=True,
            )
        return
    method = trainer.validate if command == "validate" else trainer.test
    method(task, datamodule=data, ckpt_path=ckpt_path, verbose=False, weights_only=True)
