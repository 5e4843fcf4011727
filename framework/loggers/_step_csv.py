"""The CSV logger behind `logger=csv` (imports Lightning, so it is loaded only inside workers)."""

from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import Any

from lightning.pytorch.loggers.logger import Logger, rank_zero_experiment
from lightning.pytorch.utilities import rank_zero_only


class StepCSVLogger(Logger):
    """Writes metrics.csv with one row per step; rank 0 only."""

    def __init__(self, path: Path, name: str = "run") -> None:
        super().__init__()
        self.path = Path(path)
        self._name = name
        self._columns: list[str] = ["step"]
        self._pending: dict[str, Any] | None = None
        if self.path.exists():
            with self.path.open(newline="") as fh:
                header = next(csv.reader(fh), None)
            if header:
                self._columns = header

    @property
    def name(self) -> str:
        return self._name

    @property
    def version(self) -> str:
        return ""

    @property
    def save_dir(self) -> str:
        return str(self.path.parent)

    @property
    @rank_zero_experiment
    def experiment(self) -> StepCSVLogger:
        return self

    @rank_zero_only
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        """The resolved config is in config.yaml; nothing more to write."""

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        step = int(step if step is not None else metrics.get("step", 0))
        if self._pending is not None and self._pending["step"] != step:
            self._write(self._pending)
            self._pending = None
        if self._pending is None:
            self._pending = {"step": step}
        for key, value in metrics.items():
            if key != "step":
                self._pending[key] = float(value)

    @rank_zero_only
    def save(self) -> None:
        if self._pending is not None:
            self._write(self._pending)
            self._pending = None

    @rank_zero_only
    def finalize(self, status: str) -> None:
        self.save()

    def _write(self, row: dict[str, Any]) -> None:
        new = [k for k in row if k not in self._columns]
        if new:
            self._columns = self._columns + sorted(new)
            self._rewrite_header()
        exists = self.path.exists()
        with self.path.open("a", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=self._columns)
            if not exists:
                writer.writeheader()
            writer.writerow(row)

    def _rewrite_header(self) -> None:
        if not self.path.exists():
            return
        with self.path.open(newline="") as fh:
            rows = list(csv.DictReader(fh))
        tmp = self.path.with_suffix(".csv.tmp")
        with tmp.open("w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=self._columns)
            writer.writeheader()
            writer.writerows(rows)
        os.replace(tmp, self.path)
