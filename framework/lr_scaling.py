"""`trainer.scale_lr`: the learning rate follows the global batch size (linear or square-root rule).

The learning rate a task is configured with (`task.optimizer.lr`, or whatever its own
`configure_optimizers` sets) is the one tuned at `trainer.reference_batch_size` samples per
optimizer step. Under `linear` every optimizer's learning rate is multiplied by
global / reference (Goyal et al. 2017), under `sqrt` by sqrt(global / reference) (Malladi et al.
2022, for Adam); `none` (the default) adds nothing to the run. The global batch is what one
optimizer step sees:

    data-parallel ranks x per-rank batch x trainer.accumulate_grad_batches

The data-parallel ranks are the strategy's `data_parallel` size (tensor- and pipeline-parallel
ranks of one group read the same batch, so this is not the world size); the per-rank batch is the
train DataLoader's `batch_size`, read in the worker when training starts (any data module works,
whatever its arguments are called). Warm-up stays `task.scheduler.warmup_steps` optimizer steps.

The config is checked here, in the `fw` process; the factor is applied in the workers by the
callback in `framework.runtime.lr_scaling` (added only under `linear` and `sqrt`). Importing
this module imports no torch.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from framework.errors import ConfigError

RULES = ("none", "linear", "sqrt")
RECORD_KEY = "lr_scaling"  # config.yaml's record of what the rule worked out (written by rank 0)


@dataclass(frozen=True)
class Scaling:
    """What `trainer.scale_lr` works out for one run: the global batch and the lr factor."""

    rule: str  # linear or sqrt
    reference_batch_size: int  # the global batch the configured lr was tuned at
    data_parallel: int  # ranks reading different batches (not the world size under tp/pp)
    per_rank_batch_size: int  # the train DataLoader's batch_size
    accumulate_grad_batches: int
    warmup_steps: int | None  # task.scheduler.warmup_steps (None: the task's own schedule)

    @property
    def global_batch_size(self) -> int:
        return self.data_parallel * self.per_rank_batch_size * self.accumulate_grad_batches

    @property
    def factor(self) -> float:
        return lr_factor(self.rule, self.global_batch_size, self.reference_batch_size)

    def record(self, configured: list[float], effective: list[float]) -> dict[str, Any]:
        """The values written to config.yaml and logged as hyperparameters."""
        warmup = self.warmup_steps
        return {
            **asdict(self),
            "global_batch_size": self.global_batch_size,
            "factor": self.factor,
            "configured_lr": list(configured),
            "lr": list(effective),
            "warmup_samples": None if warmup is None else warmup * self.global_batch_size,
        }

    def describe(self, configured: list[float], effective: list[float]) -> str:
        """The one line printed at start."""
        warmup = self.warmup_steps
        if warmup is None:
            warm = "warm-up: the task's own schedule"
        elif warmup == 0:
            warm = "no warm-up (task.scheduler.warmup_steps=0)"
        else:
            samples = warmup * self.global_batch_size
            warm = f"warm-up {warmup} steps ({samples} samples), unchanged"
        return (
            f"Learning rate scaled ({self.rule}): global batch {self.global_batch_size} = "
            f"{self.data_parallel} data-parallel x {self.per_rank_batch_size} per rank x "
            f"{self.accumulate_grad_batches} accumulated, reference {self.reference_batch_size} "
            f"-> lr x {self.factor:.6g} (lr {show(configured)} -> {show(effective)}); {warm}"
        )


def lr_factor(rule: str, global_batch: int, reference: int) -> float:
    """The learning-rate multiplier of `rule` for `global_batch` samples per step."""
    if rule == "linear":
        return global_batch / reference
    if rule == "sqrt":
        return math.sqrt(global_batch / reference)
    if rule == "none":
        return 1.0
    raise ConfigError("trainer.scale_lr", rule, "not a valid choice", RULES)


def show(lrs: list[float]) -> str:
    """Learning rates as printed: one value when every param group has the same."""
    distinct = list(dict.fromkeys(lrs))
    return f"{distinct[0]:.6g}" if len(distinct) == 1 else str([float(f"{v:.6g}") for v in lrs])


def check(trainer: Any) -> None:
    """Before launch: a scaling rule needs the batch its learning rate was tuned at."""
    rule = trainer.get("scale_lr", "none")
    if rule != "none" and trainer.get("reference_batch_size") is None:
        raise ConfigError(
            "trainer.reference_batch_size",
            None,
            f"trainer.scale_lr={rule} needs the global batch size (data-parallel ranks x per-rank "
            "batch x accumulate_grad_batches) the learning rate was tuned at",
            hint="Set it, e.g. trainer.reference_batch_size=64, or trainer.scale_lr=none.",
        )


def per_rank_batch_size(loader: Any, rule: str) -> int:
    """The batch size of the train loader, or a ConfigError when it has none to read."""
    size = getattr(loader, "batch_size", None)
    if size is None:  # a loader built on a batch sampler
        size = getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ConfigError(
            "trainer.scale_lr",
            rule,
            f"the per-rank batch size cannot be read from the train loader "
            f"({type(loader).__name__} with batch_size={size!r})",
            hint="Scaling needs one DataLoader with a batch_size (or a batch sampler with one); "
            "use trainer.scale_lr=none and scale task.optimizer.lr by hand.",
        )
    return size


def without_record(cfg: Any) -> Any:
    """The config without the record a previous start wrote into config.yaml (recomputed)."""
    if RECORD_KEY in cfg:
        cfg.pop(RECORD_KEY)
    return cfg
