"""The CSV logger behind `logger=csv` (imports Lightning, so it is loaded only inside workers)."""

from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import Any

from lightning.pytorch.loggers.logger import Logger, rank_zero_experiment
from lightning.pytorch.utilities import rank_zero_only

from framework import files


class StepCSVLogger(Logger):
    """Writes metrics.csv with one row per step; rank 0 only.

    Lightning calls `save()` after every `log_metrics`, and training and validation metrics of one
    step arrive in separate calls: the row of the current step is written at once and rewritten in
    place (truncate + append) when more metrics for the same step arrive.
    """

    def __init__(self, path: Path, name: str = "run", resume_step: int = 0) -> None:
        super().__init__()
        self.path = Path(path)
        self._name = name
        self._columns: list[str] = ["step"]
        self._row: dict[str, Any] | None = None  # the current step's row
        self._row_offset: int | None = None  # where that row starts in the file, once written
        if rank_zero_only.rank == 0:
            self._start(resume_step)

    def _start(self, resume_step: int) -> None:
        """Keep the rows of steps before the resumed one; reopen the last for more metrics."""
        kept: list[dict[str, Any]] = []
        if self.path.exists():
            with self.path.open(newline="") as fh:
                reader = csv.DictReader(fh)
                self._columns = list(reader.fieldnames or ["step"])
                kept = [r for r in reader if r.get("step") and int(r["step"]) < resume_step]
        self._rewrite(kept)
        if kept:
            last = {k: v for k, v in kept[-1].items() if v not in ("", None)}
            self._row = {"step": int(last.pop("step")), **{k: float(v) for k, v in last.items()}}
            self._row_offset = self._offset_of_last_row()

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
        if self._row is None or self._row["step"] != step:
            self.save()
            self._row, self._row_offset = {"step": step}, None
        for key, value in metrics.items():
            if key != "step":
                self._row[key] = float(value)

    @rank_zero_only
    def save(self) -> None:
        if self._row is None:
            return
        new = [k for k in self._row if k not in self._columns]
        if new:
            self._columns = self._columns + sorted(new)
            rows = self._read_rows()
            if self._row_offset is not None:
                rows = rows[:-1]
            self._rewrite(rows)
            self._row_offset = None
        with self.path.open("r+", newline="") as fh:
            if self._row_offset is None:
                self._row_offset = fh.seek(0, io.SEEK_END)
            fh.seek(self._row_offset)
            fh.truncate()
            csv.DictWriter(fh, fieldnames=self._columns).writerow(self._row)

    @rank_zero_only
    def finalize(self, status: str) -> None:
        self.save()

    def _offset_of_last_row(self) -> int:
        data = self.path.read_bytes()
        return data.rstrip(b"\r\n").rfind(b"\n") + 1

    def _read_rows(self) -> list[dict[str, str]]:
        with self.path.open(newline="") as fh:
            return list(csv.DictReader(fh))

    def _rewrite(self, rows: list[dict[str, Any]]) -> None:
        if rank_zero_only.rank != 0:
            return
        text = io.StringIO(newline="")
        writer = csv.DictWriter(text, fieldnames=self._columns)
        writer.writeheader()
        writer.writerows(rows)
        files.write_atomic(self.path, text.getvalue())
