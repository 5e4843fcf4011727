"""`callbacks.pruning`: a trial of `fw sweep` reports its validation metric to the Optuna study
and stops early when the study's pruner says so.

`fw sweep` adds this entry to each trial's config (`+trial=pruning`, then the storage, the
study, the trial number, the metric and the pruner); there is no reason to set it by hand. Rank 0 reports the metric after
each validation at the current optimizer step, asks the pruner, and every rank stops together.
A pruned trial's run directory holds `pruned.json` (the step and the value it stopped at), and
its log says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from framework.config.fields import doc
from framework.errors import ConfigError

PRUNERS = ("median", "successive_halving")


@dataclass
class Config:
    """Report the validation metric to a `fw sweep` study; stop when its pruner says so."""

    kind: str = doc("pruning", "Callback plugin.")
    storage: str | None = doc(None, "Database URL of the Optuna storage (set by fw sweep).")
    study: str | None = doc(None, "Name of the study (set by fw sweep).")
    trial: int | None = doc(
        None, "Number of this run's trial in the study (set by fw sweep).", min=0
    )
    metric: str = doc("val/loss", "Logged metric reported after each validation.")
    pruner: str = doc("median", "The study's pruner (framework/sweep/config.py).", PRUNERS)
    pruner_args: dict[str, Any] = doc({}, "Keyword arguments of the pruner.")


def validate(cfg: Config, world) -> None:
    import importlib.util

    missing = [k for k in ("storage", "study", "trial") if getattr(cfg, k) is None]
    if missing:
        raise ConfigError(
            f"callbacks.pruning.{missing[0]}", None, "is not set", hint="fw sweep sets it."
        )
    if importlib.util.find_spec("optuna") is None:
        raise ConfigError(
            "callbacks.pruning",
            cfg.kind,
            "the optuna package is not installed",
            hint="Install it with `pip install 'framework[sweep]'`.",
        )


def build(cfg: Config, ctx):
    from framework.callbacks.pruning.callback import Pruning

    return Pruning(cfg, ctx.run_dir)
