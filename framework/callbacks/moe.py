"""`callbacks.moe`: load-balance metrics of every mixture-of-experts layer, logged through the
normal loggers (metrics.csv, W&B), on the steps Lightning logs.

Per layer i (`moe/layer{i}/...`): `tokens_e{j}` (tokens routed to expert j in the last optimizer
step, summed over the data-parallel ranks), `max_load` (the busiest expert's tokens over the
mean: 1.0 is perfect balance), `drop` (fraction of assignments dropped by the capacity limit),
`aux_loss` (load-balancing + z-loss, when their coefficients are set), `entropy` (mean router
entropy, nats), `rows_sent` (token rows this rank sent to other expert-parallel ranks in the
last forward). Where W&B logs, `tokens_per_expert` is also a histogram. A model without MoE
layers logs nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from framework.config.fields import doc


@dataclass
class Config:
    """Mixture-of-experts load metrics."""

    kind: str = doc("moe", "Callback plugin.")
    per_expert: bool = doc(True, "Also log each expert's token count (moe/layer{i}/tokens_e{j}).")


def validate(cfg: Config, world) -> None:
    """Nothing to check before launch."""


def build(cfg: Config, ctx):
    import lightning.pytorch as pl

    from framework.parallel.experts import moe_layers

    class MoEMetrics(pl.Callback):
        """Logs what the routers counted (the strategy summed the counts over the data ranks).
        Layers are numbered in the whole model; under a pipeline each rank holds some of them,
        and rank 0 gathers every layer's figures before logging."""

        active = False  # the whole model has MoE layers (the same answer on every rank)

        def setup(self, trainer, pl_module, stage) -> None:
            for i, moe in enumerate(moe_layers(pl_module)):  # before any stage is cut
                moe.layer_index = i
                self.active = True

        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            layers = moe_layers(pl_module)
            if not self.active or not trainer._logger_connector.should_update_logs:
                return
            found: dict[str, float] = {}
            for moe in layers:
                found.update(layer_metrics(moe, cfg.per_expert))
            for name, value in gather(found, trainer).items():
                pl_module.log(name, value, rank_zero_only=True)
            for moe in layers:
                counts = getattr(moe.router, "global_counts", None)
                if counts is not None:
                    histogram(trainer, f"moe/layer{moe.layer_index}/tokens_per_expert", counts)

    return MoEMetrics()


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
    import torch.distributed as dist

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
