"""The Lightning callback behind `callbacks.moe` (imports Lightning: loaded in workers)."""

from __future__ import annotations

import lightning.pytorch as pl
import torch.distributed as dist

from framework.parallel.experts import moe_layers
from framework.runtime.hooks import skip_unused


class MoEMetrics(pl.Callback):
    """Logs what the routers counted (the strategy summed the counts over the data ranks).
    Layers are numbered in the whole model; under a pipeline each rank holds some of them,
    and rank 0 gathers every layer's figures before logging. A model without MoE layers costs
    nothing per step; one with them is read on the steps Lightning logs only."""

    def __init__(self, cfg) -> None:
        self.cfg = cfg
        self.active = False  # the whole model has MoE layers (the same answer on every rank)
        self.layers: list = []  # this rank's MoE layers, once its model is final
        skip_unused(self)

    def setup(self, trainer, pl_module, stage) -> None:
        for i, moe in enumerate(moe_layers(pl_module)):  # before any stage is cut
            moe.layer_index = i
            self.active = True

    def on_train_start(self, trainer, pl_module) -> None:
        self.layers = moe_layers(pl_module) if self.active else []  # stages cut, layers swapped
        if not self.active:
            skip_unused(self, idle=True)  # Lightning passes it by at every step

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if not self.active or not trainer._logger_connector.should_update_logs:
            return
        found: dict[str, float] = {}
        for moe in self.layers:
            found.update(layer_metrics(moe, self.cfg.per_expert))
        for name, value in gather(found, trainer).items():
            pl_module.log(name, value, rank_zero_only=True)
        for moe in self.layers:
            counts = getattr(moe.router, "global_counts", None)
            if counts is not None:
                histogram(trainer, f"moe/layer{moe.layer_index}/tokens_per_expert", counts)


def layer_metrics(moe, per_expert: bool) -> dict[str, float]:
    """One MoE layer's metrics after the last optimizer step's counts (empty before any)."""
    counts = getattr(moe.router, "global_counts", None)
    if counts is None:
        return {}
    prefix = f"moe/layer{moe.layer_index}"
    metrics = {
        f"{prefix}/max_load": float(counts.max() / counts.mean().clamp_min(1e-9)),
        f"{prefix}/drop": float(moe.dropped),
        f"{prefix}/aux_loss": float(moe.router.aux_loss.detach()),
        f"{prefix}/rows_sent": float(moe.rows_sent),
    }
    if "entropy" in moe.router.stats:
        metrics[f"{prefix}/entropy"] = float(moe.router.stats["entropy"])
    if per_expert:
        metrics.update({f"{prefix}/tokens_e{j}": float(c) for j, c in enumerate(counts)})
    return metrics


def gather(found: dict[str, float], trainer) -> dict[str, float]:
    """Every rank's layer metrics, merged (a pipeline's layers live on several ranks); the
    first rank holding a layer gives its figures. Every rank calls it (a collective)."""
    if trainer.world_size == 1 or not dist.is_initialized():
        return found
    every: list = [None] * trainer.world_size
    dist.all_gather_object(every, found)
    merged: dict[str, float] = {}
    for part in every:
        for name, value in part.items():
            merged.setdefault(name, value)
    return merged


def histogram(trainer, name: str, counts) -> None:
    """Tokens per expert as a W&B histogram, where W&B logs (rank 0)."""
    if trainer.global_rank != 0:
        return
    for logger in trainer.loggers:
        if type(logger).__name__.endswith("WandbLogger") and getattr(logger, "_experiment", None):
            import wandb

            values = [j for j, c in enumerate(counts.tolist()) for _ in range(int(c))]
            # Lightning's path: one W&B row whose x-axis is trainer/global_step (an explicit
            # `step=` would be dropped, W&B's own step counter being ahead of the trainer's).
            logger.log_metrics(
                {name: wandb.Histogram(values, num_bins=len(counts))}, step=trainer.global_step
            )
