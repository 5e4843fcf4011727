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
        """Logs what the routers counted (the strategy summed the counts over the data ranks)."""

        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            layers = moe_layers(pl_module)
            if not layers or not trainer._logger_connector.should_update_logs:
                return
            for i, moe in enumerate(layers):
                counts = getattr(moe.router, "global_counts", None)
                if counts is None:
                    continue
                prefix = f"moe/layer{i}"
                metrics = {
                    f"{prefix}/max_load": float(counts.max() / counts.mean().clamp_min(1e-9)),
                    f"{prefix}/drop": float(moe.dropped),
                    f"{prefix}/aux_loss": float(moe.router.aux_loss.detach()),
                    f"{prefix}/rows_sent": float(moe.rows_sent),
                }
                if "entropy" in moe.router.stats:
                    metrics[f"{prefix}/entropy"] = float(moe.router.stats["entropy"])
                if cfg.per_expert:
                    metrics.update(
                        {f"{prefix}/tokens_e{j}": float(c) for j, c in enumerate(counts)}
                    )
                for name, value in metrics.items():
                    pl_module.log(name, value, rank_zero_only=True)
                histogram(trainer, f"{prefix}/tokens_per_expert", counts)

    return MoEMetrics()


def histogram(trainer, name: str, counts) -> None:
    """Tokens per expert as a W&B histogram, where W&B logs (rank 0)."""
    if trainer.global_rank != 0:
        return
    for logger in trainer.loggers:
        if type(logger).__name__.endswith("WandbLogger") and getattr(logger, "_experiment", None):
            import wandb

            values = [j for j, c in enumerate(counts.tolist()) for _ in range(int(c))]
            logger.experiment.log(
                {name: wandb.Histogram(values, num_bins=len(counts))}, step=trainer.global_step
            )
