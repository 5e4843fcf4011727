"""Pipeline stages: which process runs which stage, where the model is cut, and the weights two
stages share (a tied embedding and head).

Every rank builds the whole model, so the names of tied parameters are read before the other
stages' modules are dropped; a weight used by stages on two pipeline ranks is held by both, and
its gradients are summed over a process group of exactly those ranks (one per position in the
other mesh dimensions).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist
from torch import nn

from framework.parallel import pipeline
from framework.parallel.parallelize import StageCut

log = logging.getLogger("framework.pipeline")


def stage_owners(schedule: str, pp: int, virtual: int) -> list[list[int]]:
    """The stages each pipeline rank runs: round-robin, or a V for zbv (first and last stage on
    rank 0)."""
    if schedule == "zbv":
        return [[r, 2 * pp - 1 - r] for r in range(pp)]
    return [[r + k * pp for k in range(virtual)] for r in range(pp)]


def cut(
    task: nn.Module,
    split_points: list[str],
    n_stages: int,
    mine: list[int],
    measure: Callable[[list[pipeline.Layer]], list[float]] | None = None,
) -> StageCut:
    """Where the task's layer chain is cut: at the split points, else balanced by measured
    seconds (`measure`) or by parameter count."""
    chain = pipeline.layers(task)
    if split_points:
        starts = pipeline.starts_at(chain, split_points)
    else:
        costs = measure(chain) if measure is not None else pipeline.costs(task, chain)
        starts = pipeline.balance(costs, n_stages)
    return StageCut(chain, starts, mine)


@dataclass
class TiedWeight:
    """A weight two or more pipeline ranks hold: its names, those ranks, their process group."""

    names: list[str]
    ranks: list[int]
    group: object


class Ties:
    """The tied weights of a task (found before its stages are cut)."""

    def __init__(self, task: nn.Module) -> None:
        first: dict[int, str] = {}
        self.canonical = {
            name: first.setdefault(id(p), name)
            for name, p in task.named_parameters(remove_duplicate=False)
        }
        self.across: list[TiedWeight] = []

    def aliases(self, name: str) -> list[str]:
        """Every name of the parameter called `name` (itself included)."""
        root = self.canonical.get(name, name)
        return [n for n, c in self.canonical.items() if c == root]

    def find_across(self, task, stage_cut: StageCut, rank_of: dict[int, int], grid) -> None:
        """Record the weights used by stages on different pipeline ranks; `grid` is the world
        mesh's rank tensor, pipeline first."""
        for name, _, stages in pipeline.shared_parameters(task, stage_cut.chain, stage_cut.starts):
            ranks = sorted({rank_of[s] for s in stages})
            if len(ranks) > 1:
                self.across.append(TiedWeight(self.aliases(name), ranks, group_across(grid, ranks)))

    def not_first_holder(self, name: str, pp_rank: int) -> bool:
        """Whether this rank's copy of `name` is counted on another rank (norms)."""
        return any(name in t.names and pp_rank != t.ranks[0] for t in self.across)


def group_across(grid, pp_ranks: list[int]):
    """A process group of these pipeline ranks with the same coordinates in every other mesh
    dimension as this process; every process creates every such group, as torch requires."""
    columns = grid.reshape(grid.shape[0], -1)
    mine = None
    for j in range(columns.shape[1]):
        ranks = [int(columns[r, j]) for r in pp_ranks]
        group = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            mine = group
    return mine


def check_no_local_ties(stage_cut: StageCut, task) -> None:
    """FSDP shards each stage on its own: a weight two stages of this rank share cannot be."""
    for name, _, stages in pipeline.shared_parameters(task, stage_cut.chain, stage_cut.starts):
        here = [s for s in stages if s in stage_cut.mine]
        if len(here) > 1:
            raise ValueError(
                f"{name} is used by stages {here}, which run on one process; FSDP cannot shard "
                "one weight in two stages: choose a schedule or split that keeps them apart"
            )
