"""Debugging aids users add from the command line (imports Lightning: loaded only when used).

`CommCounter`: `+callbacks.comm._target_=framework.debug.CommCounter +callbacks.comm.out=DIR`
writes DIR/comm.json with the collectives of one training step, per module and direction.
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
