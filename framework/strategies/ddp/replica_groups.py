"""The Lightning strategies of `strategy=ddp strategy.fault_tolerance=torchft` (imports torchft:
workers only): the torchft step (framework/replica_groups/steps.py) in front of a group of one
process, or of DDP inside a group of several."""

from __future__ import annotations

from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

from framework.replica_groups.steps import ReplicaSteps
from framework.strategy_base import Replicated


class ReplicaGroup(ReplicaSteps, Replicated, SingleDeviceStrategy):
    """A replica group of one process."""


class ReplicaGroupDDP(ReplicaSteps, Replicated, DDPStrategy):
    """One process of a replica group of several: DDP averages the gradients over the group
    (its own process group), then torchft over the groups, each process with its peers of
    the same rank in the other groups."""
