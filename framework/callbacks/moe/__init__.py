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
    from framework.callbacks.moe.callback import MoEMetrics

    return MoEMetrics(cfg)
