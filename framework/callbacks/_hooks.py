"""What a callback costs Lightning per step, whatever it does: for each of the six per-step hooks,
Lightning's trainer visits every callback, formats a profiler name from its `state_key` and
enters a profiler context, then calls the hook, also the do-nothing one a callback inherits from
`lightning.pytorch.Callback` (lightning/pytorch/trainer/call.py, `_call_callback_hooks`). It skips
a hook that is not callable. `skip_unused` sets to None, on the instance, the per-step hooks a
callback has nothing to do in: Lightning then passes it by at the cost of a `getattr`."""

from __future__ import annotations

import lightning.pytorch as pl

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
