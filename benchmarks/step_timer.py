"""Callbacks the benchmarks inject into `fw train` (and the plain Lightning script) from outside.

`StepTimer` records when every training batch starts and ends, and the process's minor page
faults so far at each start; `FirstStep` records how long after the benchmark launched the command
the first training batch starts. Neither changes training.
"""

from __future__ import annotations

import json
import os
import resource
import time
from pathlib import Path

import lightning.pytorch as pl
import torch


class StepTimer(pl.Callback):
    """Writes batch start/end times (perf_counter seconds) as JSON, and the net's final weights."""

    def __init__(self, path: str, weights: str | None = None) -> None:
        self.path = Path(path)
        self.weights = weights
        self.starts: list[float] = []
        self.ends: list[float] = []
        self.faults: list[int] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.starts.append(time.perf_counter())
        self.faults.append(minor_faults())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.ends.append(time.perf_counter())

    def on_train_end(self, trainer, pl_module) -> None:
        times = {"starts": self.starts, "ends": self.ends, "faults": self.faults}
        # "RANK" in the file name: one file per process
        name = self.path.name.replace("RANK", str(trainer.global_rank))
        self.path.with_name(name).write_text(json.dumps(times))
        if self.weights:
            torch.save(pl_module.net.state_dict(), self.weights)


def minor_faults() -> int:
    """Page faults this process has taken without reading from disk (e.g. on fresh memory)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


class FirstStep(pl.Callback):
    """On rank 0, writes the seconds between $BENCH_T0 (time.time()) and the first batch's start."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == 0 and batch_idx == 0 and trainer.global_rank == 0:
            self.path.write_text(str(time.time() - float(os.environ["BENCH_T0"])))
