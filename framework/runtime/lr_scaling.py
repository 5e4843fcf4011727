"""The Lightning callback behind `trainer.scale_lr` (imports Lightning: loaded in workers).

It waits for two moments of `trainer.fit`: `on_fit_start`, when the optimizers and schedulers are
built but a checkpoint's optimizer state is not yet loaded (so the learning rates are the
configured ones), and `on_train_start`, when the train loader exists (its batch size is the
per-rank batch) and a resumed optimizer state is loaded, before the first optimizer step. There
it sets each param group's learning rate to configured x factor: a resume under the same global
batch finds exactly that and changes nothing; one under another global batch is moved to the new
value and says so. Its record rides in every checkpoint (`state_dict`), so a resume knows the
global batch it was trained with.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from omegaconf import OmegaConf

from framework.checkpoint import disk
from framework.lr_scaling import RECORD_KEY, Scaling, per_rank_batch_size, show

log = logging.getLogger("framework.lr_scaling")


class LRScaling(pl.Callback):
    """Multiplies every optimizer's learning rate by the `trainer.scale_lr` factor at start."""

    def __init__(
        self,
        rule: str,
        reference_batch_size: int,
        data_parallel: int,
        accumulate_grad_batches: int,
        warmup_steps: int | None,
        config_path: Path,
    ) -> None:
        self.rule = rule
        self.reference_batch_size = reference_batch_size
        self.data_parallel = data_parallel
        self.accumulate_grad_batches = accumulate_grad_batches
        self.warmup_steps = warmup_steps
        self.config_path = Path(config_path)
        self.configured: list[float] = []  # every param group's lr before scaling
        self.record: dict[str, Any] = {}  # what this run works out (config.yaml, checkpoints)
        self.saved: dict[str, Any] | None = None  # the record of the resumed checkpoint

    def state_dict(self) -> dict[str, Any]:
        return dict(self.record)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.saved = dict(state_dict)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.configured = [base_lr(group, sched, i) for group, sched, i in lr_slots(trainer)]

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        scaling = Scaling(
            self.rule,
            self.reference_batch_size,
            self.data_parallel,
            per_rank_batch_size(trainer.train_dataloader, self.rule),
            self.accumulate_grad_batches,
            self.warmup_steps,
        )
        slots = lr_slots(trainer)
        restored = [base_lr(group, sched, i) for group, sched, i in slots]
        effective = [lr * scaling.factor for lr in self.configured]
        for (group, sched, i), lr in zip(slots, effective, strict=True):
            set_base_lr(group, sched, i, lr)
        self.record = scaling.record(self.configured, effective)
        for logger in trainer.loggers:
            logger.log_hyperparams({RECORD_KEY: self.record})
        if not trainer.is_global_zero:
            return
        log.info(scaling.describe(self.configured, effective))
        if scaling.rule == "linear" and scaling.factor > 1 and scaling.warmup_steps == 0:
            log.warning(
                "Linear scaling raises the learning rate %.6gx with no warm-up; Goyal et al. "
                "(2017) warm up gradually: set task.scheduler.warmup_steps.",
                scaling.factor,
            )
        if trainer.ckpt_path is not None and restored != effective:
            log.info(resume_change(self.saved, self.record, restored, effective))
        write_record(self.config_path, self.record)


def callbacks(trainer: Any, data_parallel: int, task: Any, config_path: Path) -> list[Any]:
    """The worker's scaling callback, or none under `scale_lr: none` (the run stays untouched)."""
    rule = trainer.get("scale_lr", "none")
    if rule == "none":
        return []
    return [
        LRScaling(
            rule,
            int(trainer.reference_batch_size),
            data_parallel,
            int(trainer.accumulate_grad_batches),
            warmup_steps(task),
            config_path,
        )
    ]


def warmup_steps(task: Any) -> int | None:
    """The warm-up of a TaskModule's configured schedule (None: a task with its own)."""
    from framework.task import TaskModule

    if not isinstance(task, TaskModule):
        return None
    return int(task.scheduler_config.get("warmup_steps", 0))


def lr_slots(trainer: pl.Trainer) -> list[tuple[dict, Any, int]]:
    """(param group, the scheduler holding its base lr or None, its index there) for every
    param group of every optimizer, in a fixed order. Matched through the scheduler's optimizer,
    so a wrapped optimizer (DeepSpeed's) whose groups are the wrapped one's is found too."""
    slots: dict[int, tuple[dict, Any, int]] = {}
    for config in trainer.lr_scheduler_configs:
        sched = config.scheduler
        if hasattr(sched, "base_lrs"):  # torch's LRScheduler family
            for i, group in enumerate(sched.optimizer.param_groups):
                slots.setdefault(id(group), (group, sched, i))
    for optimizer in trainer.optimizers:
        for group in optimizer.param_groups:
            slots.setdefault(id(group), (group, None, 0))
    return list(slots.values())


def base_lr(group: dict, sched: Any, index: int) -> float:
    """The lr a group's schedule multiplies (its peak), or its lr when nothing schedules it."""
    return float(sched.base_lrs[index] if sched is not None else group["lr"])


def set_base_lr(group: dict, sched: Any, index: int, lr: float) -> None:
    """Set a group's peak lr; its current lr (mid-warm-up, mid-decay) moves in proportion."""
    if sched is None:
        group["lr"] = lr
    else:
        old = float(sched.base_lrs[index])
        if old != lr:
            group["lr"] = group["lr"] * lr / old if old else lr
            sched.base_lrs[index] = lr
    if "initial_lr" in group:  # what a scheduler built later would start from
        group["initial_lr"] = lr


def resume_change(
    saved: dict[str, Any] | None,
    record: dict[str, Any],
    restored: list[float],
    effective: list[float],
) -> str:
    """The line a resume under another global batch prints."""
    before = saved.get("global_batch_size") if saved else None
    was = f"{before} ({saved['data_parallel']} data-parallel)" if before else "unscaled"
    return (
        f"Learning-rate scaling changed on resume: global batch {was} -> "
        f"{record['global_batch_size']} ({record['data_parallel']} data-parallel), "
        f"lr {show(restored)} -> {show(effective)}"
    )


def write_record(config_path: Path, record: dict[str, Any]) -> None:
    """Add the record to the run's config.yaml, so the run directory says what was used."""
    cfg = OmegaConf.load(config_path)
    cfg[RECORD_KEY] = record
    disk.write_text_atomic(config_path, OmegaConf.to_yaml(cfg))
