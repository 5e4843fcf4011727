"""`callbacks.lr_monitor`: logs the learning rate of every optimizer as `lr-<name>`."""

from __future__ import annotations

from dataclasses import dataclass

from framework.config.fields import doc


@dataclass
class Config:
    """Log learning rates."""

    kind: str = doc("lr_monitor", "Callback plugin.")
    logging_interval: str = doc("step", "Log at every step or every epoch.", ("step", "epoch"))


def validate(cfg: Config, world) -> None:
    """Nothing to check before launch."""


def build(cfg: Config, ctx):
    from framework.callbacks.lr_monitor.callback import LRMonitor

    return LRMonitor(logging_interval=cfg.logging_interval)
