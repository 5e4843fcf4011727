"""What a callback costs Lightning per step, whatever it does: for each of the six per-step hooks,
Lightning's trainer visits every callback, formats a profiler name from its `state_key` and
enters a profiler context, then calls the hook, also the do-nothing one a callback inherits from
`lightning.pytorch.Callback` (lightning/pytorch/trainer/call.py, `_call_callback_hooks`). It skips
a hook that is not callable. `skip_unused` sets to None, on the instance, the per-step hooks a
callback has nothing to do in: Lightning then passes it by at the cost of a `getattr`.

The profiler context itself is the other fixed cost: Lightning wraps every hook it calls (about
29 a step on digits: the callbacks', the LightningModule's, the strategy's) in
`trainer.profiler.profile(name)`, and its default `PassThroughProfiler` builds a generator-based
context manager for each, which does nothing. `QuietProfiler` is that profiler with one shared
no-op context: fw's Trainer gets it when `trainer.profiler` is unset."""

from __future__ import annotations

import contextlib

import lightning.pytorch as pl
from lightning.pytorch.profilers import PassThroughProfiler

PER_STEP = (
    "on_train_batch_start",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_before_zero_grad",
    "on_train_batch_end",
)


def skip_unused(callback: pl.Callback, idle: bool = False) -> None:
    """Hide from Lightning the per-step hooks `callback` does not override (every one when
    `idle`, for a callback with nothing to do in this run)."""
    for name in PER_STEP:
        if idle or getattr(type(callback), name) is getattr(pl.Callback, name):
            setattr(callback, name, None)


class QuietProfiler(PassThroughProfiler):
    """Lightning's profiler that records nothing, without building a context manager per hook
    call: every `profile(name)` is the same reusable `nullcontext`."""

    _nothing = contextlib.nullcontext()

    def profile(self, action_name: str) -> contextlib.nullcontext:
        return self._nothing
