"""Debugging aids users add from the command line (imports Lightning: loaded only when used).

`CommCounter`: `+callbacks.comm._target_=framework.debug.CommCounter +callbacks.comm.out=DIR`
writes DIR/comm.json with the collectives of one training step, per module and direction.

`PeakMemory`: `+callbacks.peak._target_=framework.debug.PeakMemory +callbacks.peak.out=DIR`
writes DIR/rank<R>.json with each rank's resident-memory high-water mark after its first
optimizer step (the build, any pretrained load or resume, and one step: what a resume costs over a
fresh start of the same job is the difference between the two runs' figures) and at the end.
"""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl


class CommCounter(pl.Callback):
    """Counts the collectives of one training step with torch's CommDebugMode, per module.

    At step `step` on rank 0, writes {module name: {"forward": {op: n}, "backward": {op: n}}} for
    every module that issued a collective to `out`/comm.json.
    """

    def __init__(self, out: str, step: int = 2) -> None:
        self.out = out
        self.step = step
        self.mode = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            from torch.distributed.tensor.debug import CommDebugMode

            self.mode = CommDebugMode()
            self.mode.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.mode is None:
            return
        self.mode.__exit__(None, None, None)
        counts = {
            fqn: {
                phase: {str(op).split(".")[-1]: n for op, n in ops.items()}
                for phase, ops in by_phase.items()
            }
            for fqn, by_phase in self.mode.comm_module_counts.items()
        }
        self.mode = None
        if trainer.global_rank == 0:
            (Path(self.out) / "comm.json").write_text(json.dumps(counts, indent=1, default=str))


class PeakMemory(pl.Callback):
    """Each rank's resident-memory high-water mark since its process started (VmHWM, across the
    resets of the load reports), after its first optimizer step of this fit and at the end,
    written to `out`/rank<R>.json (bytes)."""

    def __init__(self, out: str) -> None:
        self.out = Path(out)
        self.figures: dict[str, int] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if "first_step" not in self.figures:
            from framework.memory import lifetime_peak_rss

            self.figures["first_step"] = lifetime_peak_rss()
            self._write(trainer)

    def on_train_end(self, trainer, pl_module) -> None:
        from framework.memory import lifetime_peak_rss

        self.figures["end"] = lifetime_peak_rss()
        self._write(trainer)

    def _write(self, trainer) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(self.figures))
