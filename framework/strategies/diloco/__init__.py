"""`strategy=diloco|localsgd`: data parallel that synchronises every `sync_every` steps.

Each process runs the task's own optimizer (the inner one) on its own shard of the global data
order for `sync_every` = H optimizer steps with no gradient all-reduce. Then the pseudo-gradient,
the parameters at the start of the round minus the current ones, is averaged over the processes
(one all-reduce) and an outer optimizer applies it to the start-of-round parameters; every
process continues from the result (DiLoCo, Douillard et al. 2023). `localsgd` is the special case
outer SGD with lr 1 and no momentum: the new parameters are the average of the processes'.

With `fragments` > 1 the parameters are cut into that many pieces synchronised at staggered
steps (streaming DiLoCo, Douillard et al. 2025): the same bytes per round, spread over it.
Checkpoints are one Lightning file, as ddp's; mid-round they also hold every process's own
parameters and inner optimizer state (see framework/strategies/diloco/rounds.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from framework.config.fields import doc
from framework.config.schema import CollectiveSettings
from framework.errors import ConfigError
from framework.world import World, collective_backend, local_device

OUTER_OPTIMIZERS = ("sgd",)
PSEUDO_GRAD_DTYPES = ("fp32", "bf16")


@dataclass
class OuterOptimizer:
    """The optimizer applied to the averaged pseudo-gradient once per round."""

    name: str = doc("sgd", "Outer optimizer.", OUTER_OPTIMIZERS)
    lr: float = doc(0.7, "Outer learning rate (1 with momentum 0: plain averaging).", above=0)
    momentum: float = doc(0.9, "Outer momentum.", min=0, max=1)
    nesterov: bool = doc(True, "Nesterov momentum (needs momentum > 0).")


@dataclass
class Config(CollectiveSettings):
    """DiLoCo / local SGD: inner steps without communication, an outer step every H steps."""

    kind: str = doc("diloco", "Strategy plugin.")
    sync_every: int = doc(
        16, "Inner optimizer steps per round (H): one all-reduce every H steps.", min=1
    )
    outer_optimizer: OuterOptimizer = doc(OuterOptimizer(), "The outer optimizer.")
    pseudo_grad_dtype: str = doc(
        "fp32",
        "dtype the pseudo-gradient is sent in (bf16: half the bytes, rounded).",
        PSEUDO_GRAD_DTYPES,
    )
    fragments: int = doc(
        1, "Streaming: parameter fragments synchronised at staggered steps (1: all at once).", min=1
    )


def validate(cfg: Config, world: World, job: Any) -> None:
    collective_backend(cfg.backend, world)
    check_outer(cfg)
    if cfg.fragments > cfg.sync_every:
        raise ConfigError(
            "strategy.fragments",
            cfg.fragments,
            f"more fragments than steps per round (sync_every={cfg.sync_every}): each "
            "fragment is synchronised at its own step of the round",
            hint=f"Use at most {cfg.sync_every} fragments.",
        )


def check_outer(cfg: Config) -> None:
    """The outer optimizer's settings, which compose-time checks see only field by field."""
    outer = cfg.outer_optimizer
    if outer.name not in OUTER_OPTIMIZERS:  # out-of-tree configs are typed here, not by Hydra
        raise ConfigError(
            "strategy.outer_optimizer.name", outer.name, "no such outer optimizer", OUTER_OPTIMIZERS
        )
    if outer.nesterov and outer.momentum == 0:
        raise ConfigError(
            "strategy.outer_optimizer.nesterov",
            outer.nesterov,
            "Nesterov momentum needs strategy.outer_optimizer.momentum > 0",
            ["false"],
        )


def checkpoint_format(cfg: Config, world: World) -> str:
    return "lightning"  # ddp's file, plus the outer state under the key "diloco"


def check_move(cfg: Config, source: str) -> None:
    """Any layout can be moved in (whole tensors); the first round starts at the resumed step."""


def data_traffic(cfg: Config, world: World, grads: int, params: int) -> float:
    """One all-reduce of the pseudo-gradient per round of `sync_every` steps (fragments spread
    the same bytes over the round), in `pseudo_grad_dtype`: per step, 2 x its bytes / H (ring
    volume, as ddp's 2 x grads every step). The parameters are taken as fp32, as under every
    mixed precision."""
    size = 2 if cfg.pseudo_grad_dtype == "bf16" else 4
    return 2 * params / 4 * size / cfg.sync_every


def data_overlap(cfg: Config, world: World) -> float:
    """The pseudo-gradient's all-reduce runs after the round's last inner step, blocking
    (framework/strategies/diloco/rounds.py): nothing hides it."""
    return 0.0


def data_parallel(cfg: Config, world: World) -> tuple[int, int]:
    return world.rank, world.world_size


def build(cfg: Config, world: World, inputs):
    from framework.strategies.diloco.strategy import DiLoCoDDP, DiLoCoSingleDevice

    if world.world_size == 1:
        return DiLoCoSingleDevice(cfg, device=local_device(world), inputs=inputs)
    return DiLoCoDDP(
        cfg,
        inputs=inputs,
        process_group_backend=collective_backend(cfg.backend, world),
        timeout=timedelta(seconds=cfg.timeout_s),
    )
