"""The world size of an elastic job (`launcher.min_nodes` below `trainer.num_nodes`), logged with
every training step: metrics.csv's `world_size` column shows where the job shrank and grew."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl


class WorldSizeLog(pl.Callback):
    """Logs `world_size` (the processes of this start of the job) at every training step."""

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        pl_module.log("world_size", float(trainer.world_size), on_step=True, on_epoch=False)


def callbacks(cfg: Any) -> list[Any]:
    """The worker's world-size log, for an elastic job only (other runs stay untouched)."""
    launcher = cfg.get("launcher") or {}
    min_nodes = launcher.get("min_nodes")
    if min_nodes is None or int(min_nodes) >= int(cfg.trainer.num_nodes):
        return []
    return [WorldSizeLog()]
