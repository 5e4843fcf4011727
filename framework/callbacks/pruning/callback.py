"""The Lightning half of `callbacks.pruning` (see pruning.py)."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Callback

from framework.checkpoint import disk

log = logging.getLogger("framework.sweep")


class Pruning(Callback):
    """Rank 0 reports each validation value to the trial; all ranks stop when it is pruned."""

    def __init__(self, cfg: Any, run_dir: Path) -> None:
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self._trial = None

    def setup(self, trainer, pl_module, stage: str) -> None:
        if trainer.is_global_zero and self._trial is None:
            self._trial = open_trial(self.cfg)

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking:
            return
        prune = False
        value = trainer.callback_metrics.get(self.cfg.metric)
        if trainer.is_global_zero and value is not None:
            value, step = float(value), trainer.global_step
            self._trial.report(value, step)
            prune = self._trial.should_prune()
            if prune:
                disk.write_json_atomic(
                    self.run_dir / "pruned.json",
                    {
                        "trial": self.cfg.trial,
                        "step": step,
                        "metric": self.cfg.metric,
                        "value": value if math.isfinite(value) else str(value),
                    },
                )
                log.info(
                    "Trial %d pruned at step %d (%s=%.6g): stopping.",
                    self.cfg.trial,
                    step,
                    self.cfg.metric,
                    value,
                )
        if trainer.strategy.broadcast(prune, src=0):
            trainer.should_stop = True


def open_trial(cfg: Any) -> Any:
    """The running trial `cfg.trial` of the study, with the study's pruner."""
    import optuna

    from framework.sweep.config import pruner
    from framework.sweep.study import open_storage

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = open_storage(cfg.storage)
    study = optuna.load_study(
        study_name=cfg.study,
        storage=storage,
        pruner=pruner(cfg.pruner, cfg.pruner_args),
        sampler=optuna.samplers.RandomSampler(),  # nothing is sampled here
    )
    trial_id = storage.get_trial_id_from_study_id_trial_number(
        storage.get_study_id_from_name(cfg.study), cfg.trial
    )
    return optuna.trial.Trial(study, trial_id)
