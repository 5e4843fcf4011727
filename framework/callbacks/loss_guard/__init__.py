"""`callbacks.loss_guard`: a bad step does not cost the run.

Off by default; add it with `+callbacks.loss_guard.kind=loss_guard` (and its fields as
`+callbacks.loss_guard.action=rollback`). After each step's backward, before the optimizer
steps, every rank reports the loss it computed (pipeline: only the last stage has one) and
whether its gradients are finite; one all-reduce gives every rank the same mean loss and the
same verdict. A step is bad when the loss or a gradient norm is not finite, or, once `warmup`
steps are seen, when the loss exceeds mean + `z` x std of the last `window` good losses. Under
`16-mixed` the gradient scaler's overflows (non-finite gradients with a finite loss, at its first
steps and at each growth probe) are the scaler's to handle: it skips the step and lowers its
scale; they are bad steps only once the scale has fallen below 1. Then:

- `skip`: the gradients are dropped on every rank, so the optimizer step changes nothing (no
  update, no momentum, no weight decay); training goes on with the next batch.
- `rollback`: the newest checkpoint of this run (written before the bad step) is loaded into
  the running processes, model, optimizer and schedule; training goes on with the batch after
  the bad one, so the batches since the checkpoint are skipped. Their sample ids (where the
  framework's global order knows them) go to RUN_DIR/skipped.jsonl and the log. With no
  checkpoint yet, the step is skipped instead.
- `stop`: every rank stops before the optimizer step with an error naming the step and batch;
  nothing of the bad step is saved, and the job exits non-zero.

Every bad step is logged and appended to RUN_DIR/skipped.jsonl (rank 0), one JSON object per
line: step, epoch, batch, reason, loss, action, and for a rollback the checkpoint step and the
skipped sample ids. The global step keeps counting the batches trained or skipped.
"""

from __future__ import annotations

from dataclasses import dataclass

from framework.config.fields import doc

ACTIONS = ("skip", "rollback", "stop")


@dataclass
class Config:
    """Detect a non-finite or spiking loss and skip the step, roll back, or stop."""

    kind: str = doc("loss_guard", "Callback plugin.")
    action: str = doc("skip", "What a bad step does: skip it, roll back, or stop.", ACTIONS)
    z: float = doc(6.0, "A loss above mean + z x std of the window is a spike.", above=0.0)
    window: int = doc(50, "Trailing good losses the spike test compares against.", min=2)
    warmup: int = doc(20, "Good steps seen before spikes are looked for (at least 2).", min=2)
    grad_norm: bool = doc(True, "Also treat a non-finite gradient norm as bad.")


def validate(cfg: Config, world) -> None:
    """The choices and bounds are declared on the fields (unknown action, z <= 0, window < 2)."""


def build(cfg: Config, ctx):
    from framework.callbacks.loss_guard.callback import LossGuard

    return LossGuard(cfg, ctx)
