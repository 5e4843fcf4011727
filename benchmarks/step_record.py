"""Per-step losses and the timed window of a training run, kept the same way on both sides of the
GPU benchmark (`benchmarks/gpu.py`): `StepLog` in the hand-written loop, and inside `fw train`
through the `StepRecorder` callback, added from the command line
(`+callbacks.record._target_=benchmarks.step_record.StepRecorder`).

On CUDA the host runs ahead of the device, so host timestamps of single steps say little. The
window is therefore drained at both ends: `torch.cuda.synchronize()` at the start of step
`warmup` and at the end of the last step, so it holds exactly the device work of those steps
(data loading and every hook in between included). Losses are kept as device tensors and read
only at the end, so recording them adds no synchronization per step.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import lightning.pytorch as pl
import torch


class StepLog:
    """Losses of every step, and the wall time of steps `warmup` .. `steps - 1`."""

    def __init__(self, steps: int, warmup: int, device: torch.device) -> None:
        if not 0 <= warmup < steps:
            raise ValueError(f"warmup={warmup} must be below steps={steps}")
        self.steps = steps
        self.warmup = warmup
        self.device = device
        self.step = 0  # steps finished
        self.losses: list[torch.Tensor] = []
        self.window: tuple[float, float] = (0.0, 0.0)

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def start(self) -> None:
        """At the start of a step, its batch already on the device."""
        if self.step == self.warmup:
            self._synchronize()
            self.window = (time.perf_counter(), 0.0)

    def end(self, loss: torch.Tensor) -> None:
        """At the end of a step, after the optimizer's."""
        self.losses.append(loss.detach())
        self.step += 1
        if self.step == self.steps:
            self._synchronize()
            self.window = (self.window[0], time.perf_counter())

    def result(self) -> dict:
        """Losses (floats), the timed steps and their seconds, the device and its peak memory."""
        cuda = self.device.type == "cuda"
        return {
            "losses": [float(v) for v in self.losses],
            "timed_steps": self.steps - self.warmup,
            "seconds": self.window[1] - self.window[0],
            "device_name": torch.cuda.get_device_name(self.device) if cuda else "cpu",
            "peak_memory_bytes": torch.cuda.max_memory_allocated(self.device) if cuda else None,
        }


class StepRecorder(pl.Callback):
    """Keeps a `StepLog` of the training steps; rank 0 writes its `result()` as JSON to `path`."""

    def __init__(self, path: str, warmup: int) -> None:
        self.path = Path(path)
        self.warmup = warmup
        self.log: StepLog | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        self.log = StepLog(trainer.max_steps, self.warmup, pl_module.device)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.log.start()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.log.end(outputs["loss"])

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.global_rank == 0:
            self.path.write_text(json.dumps(self.log.result()))
