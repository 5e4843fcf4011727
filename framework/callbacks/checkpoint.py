"""`callbacks.checkpoint`: checkpoints in `<run dir>/checkpoints/`, with a `last.ckpt`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from framework.config.fields import doc


@dataclass
class Config:
    """Save checkpoints every N steps and/or after validation."""

    kind: str = doc("checkpoint", "Callback plugin.")
    every_n_steps: int | None = doc(
        None, "Save every N optimizer steps (None: after each validation)."
    )
    save_last: bool = doc(True, "Keep checkpoints/last.ckpt pointing at the newest checkpoint.")
    save_top_k: int = doc(1, "Keep the best K checkpoints by `monitor` (-1: all).")
    monitor: str | None = doc(
        None, "Metric ranking checkpoints, e.g. val/loss (None: newest wins)."
    )
    mode: str = doc("min", "Whether a lower or a higher `monitor` value is better.", ("min", "max"))
    save_on_train_end: bool = doc(True, "Also save when training stops between checkpoints.")


def build(cfg: Config, run_dir: Path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    class StepCheckpoint(ModelCheckpoint):
        """ModelCheckpoint that also saves the final step when training stops mid-interval."""

        def on_train_end(self, trainer, pl_module) -> None:
            step = trainer.global_step
            if cfg.save_on_train_end and step and self._last_global_step_saved != step:
                candidates = self._monitor_candidates(trainer)
                self._save_topk_checkpoint(trainer, candidates)
                self._save_last_checkpoint(trainer, candidates)

    return StepCheckpoint(
        dirpath=Path(run_dir) / "checkpoints",
        filename="step{step:08d}",
        auto_insert_metric_name=False,
        every_n_train_steps=cfg.every_n_steps,
        save_last=cfg.save_last,
        save_top_k=cfg.save_top_k,
        monitor=cfg.monitor,
        mode=cfg.mode,
    )
