"""TaskModule: the class users subclass to describe what to train.

A TaskModule is a LightningModule: build the model in `__init__`, write `training_step` (and
`validation_step`), log with `self.log`. What it adds is that the optimizer and the learning-rate
schedule come from the config (`task.optimizer`, `task.scheduler`), so they can be changed on the
command line; override `configure_optimizers` to take over. A plain LightningModule works too.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import lightning.pytorch as pl
import torch
from hydra.utils import get_class


class TaskModule(pl.LightningModule):
    """Base class of tasks: a LightningModule whose optimizer and schedule are set by the config."""

    def __init__(self) -> None:
        super().__init__()
        self.optimizer_config: dict[str, Any] = {"_target_": "torch.optim.AdamW", "lr": 1e-3}
        self.scheduler_config: dict[str, Any] = {"name": "constant", "warmup_steps": 0}

    def configure_from(self, optimizer: dict[str, Any], scheduler: dict[str, Any]) -> None:
        """Called by the runner with the `task.optimizer` and `task.scheduler` config nodes."""
        self.optimizer_config = dict(optimizer)
        self.scheduler_config = dict(scheduler)

    # Under pipeline parallelism: the stages this process runs (None: it holds the whole model).
    pipeline_stages: list[int] | None = None

    def pipeline_batch(self, batch: Any) -> tuple[Any, Any]:
        """(model input, loss target) of a batch, for pipeline parallelism: the first stage gets
        the input, the last one computes `loss(output, target)`. Default: `batch` is (x, y)."""
        x, y = batch
        return x, y

    def loss(self, output: Any, target: Any) -> torch.Tensor:
        """The loss of the model's output (mean over the batch). Pipeline parallelism calls it on
        the last stage, once per microbatch, in place of `training_step`/`validation_step`."""
        raise NotImplementedError(f"{type(self).__name__} defines no loss(output, target)")

    def param_groups(self) -> Iterable[Any]:
        """Parameters (or parameter groups) given to the optimizer; override to e.g. skip decay."""
        return self.parameters()

    def configure_optimizers(self) -> Any:
        optimizer = self.make_optimizer()
        scheduler = self.make_scheduler(
            optimizer, lambda: int(self.trainer.estimated_stepping_batches)
        )
        if scheduler is None:
            return optimizer
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }

    def make_optimizer(self) -> torch.optim.Optimizer:
        """The optimizer `task.optimizer` names, with its arguments, over `param_groups()`;
        a Muon (framework.optim.Muon, or torch.optim.Muon, run by it) over those groups split
        into the hidden 2-D weights and the rest (framework/optim/muon.py)."""
        kwargs = {k: v for k, v in self.optimizer_config.items() if k != "_target_"}
        for key in ("betas", "ns_coefficients"):
            if key in kwargs:
                kwargs[key] = tuple(kwargs[key])
        from framework.optim.muon import Muon, from_torch, split_groups

        cls = get_class(self.optimizer_config["_target_"])
        if cls is torch.optim.Muon:  # 2-D tensors only: the split needs AdamW beside it
            cls, kwargs = Muon, from_torch(kwargs)
        if isinstance(cls, type) and issubclass(cls, Muon):
            return cls(split_groups(self, self.param_groups()), **kwargs)
        return cls(self.param_groups(), **kwargs)

    def make_scheduler(self, optimizer, total_steps) -> Any:
        """The LR schedule `task.scheduler` describes (None: a constant lr, no scheduler);
        `total_steps()` gives the training's optimizer steps, asked only when needed."""
        sched = self.scheduler_config
        if sched.get("name", "constant") == "constant" and not sched.get("warmup_steps", 0):
            return None
        lr_lambda = schedule(
            sched.get("name", "constant"),
            int(sched.get("warmup_steps", 0)),
            max(1, total_steps()),
            float(sched.get("min_lr_ratio", 0.1)),
        )
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)


def schedule(name: str, warmup: int, total: int, min_ratio: float):
    """Multiplier of the peak lr at each optimizer step: linear warm-up, then constant/cosine/linear."""

    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if name == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        if name == "cosine":
            return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        return 1.0 - (1 - min_ratio) * progress

    return factor
