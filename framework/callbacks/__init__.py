"""Callback plugins: one package per plugin, its light config half in `__init__.py` and its
Lightning callback in `callback.py`; entries are named in `callbacks.*`. `KINDS` lists them."""

KINDS = (
    "checkpoint",
    "loss_guard",
    "lr_monitor",
    "moe",
    "profile",
    "pruning",
    "stragglers",
    "throughput",
)
