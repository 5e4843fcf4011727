"""The global batch of an elastic job (`launcher.min_nodes` below `trainer.num_nodes`).

When a node is lost the job continues on fewer nodes (framework.launch.elastic), with the same
global batch: data-parallel ranks x per-rank batch x `trainer.accumulate_grad_batches`. Fewer
ranks take a larger per-rank batch (`task.data.batch_size`, when the data module has one) with
the same accumulation, so each optimizer step sees the same samples, the learning rate stays as
it is, and the logged loss is still the mean over the global batch; where no per-rank batch
divides, the accumulation grows instead. Every world size the job may shrink to is checked before
launch (`check`); each worker applies the choice for the world it finds (`fit_plan`).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from framework.errors import ConfigError
from framework.plugins import load_plugin, typed_config
from framework.world import World

log = logging.getLogger("framework.elastic")


def batch_choice(
    ranks_planned: int, per_rank: int | None, accumulate: int, ranks: int
) -> tuple[int | None, int] | None:
    """(per-rank batch, accumulation) that keep the planned global batch on `ranks`
    data-parallel ranks (per_rank None: the data module's batch size is not known, only the
    accumulation may change); None when no exact choice exists."""
    if per_rank is None:
        total = ranks_planned * accumulate  # per-rank batches in one optimizer step
        return (None, total // ranks) if total % ranks == 0 else None
    global_batch = ranks_planned * per_rank * accumulate
    if global_batch % ranks:
        return None
    share = global_batch // ranks  # samples per rank per optimizer step
    if share % accumulate == 0:
        return share // accumulate, accumulate
    return (per_rank, share // per_rank) if share % per_rank == 0 else None


def check(config: dict[str, Any], world: World, min_nodes: int) -> None:
    """Refuse, before launch, an elastic job whose global batch some allowed smaller world
    cannot keep exactly (`config`: the job's resolved config as a plain dict)."""
    plugin = load_plugin("strategy", config["strategy"]["kind"], "strategy.kind")
    strategy = typed_config(plugin, config["strategy"])
    planned = plugin.data_parallel(strategy, world)[1]
    per_rank = (config["task"].get("data") or {}).get("batch_size")
    accumulate = int(config["trainer"].get("accumulate_grad_batches") or 1)
    for nodes in range(min_nodes, world.num_nodes):
        smaller = smaller_world(world, nodes)
        try:
            ranks = plugin.data_parallel(strategy, smaller)[1]
        except (ConfigError, ValueError) as err:
            raise ConfigError(
                "launcher.min_nodes",
                min_nodes,
                f"strategy {config['strategy']['kind']} cannot run on {nodes} node(s): {err}",
            ) from None
        if batch_choice(planned, per_rank, accumulate, ranks) is None:
            what = f"{planned} x {per_rank} x {accumulate}" if per_rank else f"{planned} x ?"
            raise ConfigError(
                "launcher.min_nodes",
                min_nodes,
                f"on {nodes} node(s) ({ranks} data-parallel ranks) no per-rank batch x "
                f"accumulation keeps the global batch (data-parallel x per-rank batch x "
                f"accumulation = {what})",
                hint="Choose task.data.batch_size and trainer.accumulate_grad_batches so that "
                "every world size from min_nodes to num_nodes divides the global batch, or "
                "raise launcher.min_nodes.",
            )


def smaller_world(world: World, nodes: int) -> World:
    return dataclasses.replace(world, world_size=world.devices * nodes, num_nodes=nodes)


def fit_plan(plan: Any) -> Any:
    """In a worker: when the launcher formed a smaller world than planned (a node was lost), the
    job plan (framework.config.job_plan) with its real node count and data-parallel place, and
    its config with the per-rank batch and accumulation that keep the global batch."""
    cfg, world = plan.cfg, plan.world
    planned = World.planned(cfg.trainer)
    if world.world_size == planned.world_size:
        return plan
    world = smaller_world(world, world.world_size // world.devices)
    plugin, strategy = plan.strategy_plugin, plan.strategy
    per_rank = (cfg.task.get("data") or {}).get("batch_size")
    accumulate = int(cfg.trainer.get("accumulate_grad_batches") or 1)
    ranks = plugin.data_parallel(strategy, world)[1]
    choice = batch_choice(plugin.data_parallel(strategy, planned)[1], per_rank, accumulate, ranks)
    if choice is None:  # checked before launch for every allowed world size
        raise ConfigError("launcher.min_nodes", world.num_nodes, "no exact global batch")
    size, accumulate = choice
    if size is not None:
        cfg.task.data.batch_size = size
    cfg.trainer.accumulate_grad_batches = accumulate
    if world.rank == 0:
        log.info(
            "World size %d of %d (%d node(s)): per-rank batch %s x %d accumulated on %d "
            "data-parallel ranks keeps the global batch",
            world.world_size,
            planned.world_size,
            world.num_nodes,
            size if size is not None else per_rank,
            accumulate,
            ranks,
        )
    from framework.config import job_plan

    smaller = job_plan.make(cfg, world, plugin, strategy)  # the strategy's facts for this world
    return dataclasses.replace(
        smaller, launcher_plugin=plan.launcher_plugin, launcher=plan.launcher
    )
