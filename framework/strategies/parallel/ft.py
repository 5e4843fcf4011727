"""The Lightning strategy of `strategy=fsdp strategy.fault_tolerance=torchft` (imports torchft:
workers only): HSDP across machines that may fail. Each `fw train` command is one replica group
whose processes shard the model with FSDP2 (fsdp = the group's processes, no other degree);
after FSDP2's reduce-scatter inside the group, each process averages its gradient shards with
the process of the same rank in the other groups (they hold the same shards) through its torchft
Manager; the step, the quorum, the commit vote and the heal from a live peer are
framework/replica_groups/steps.py, as under strategy=ddp.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from framework.replica_groups import first_gpu
from framework.replica_groups.steps import ReplicaSteps
from framework.strategies.parallel.strategy import ParallelStrategy
from framework.world import parallel_devices


class ReplicaGroupFSDP(ReplicaSteps, ParallelStrategy):
    """One process of a replica group that shards the model over its processes (FSDP2)."""

    def __init__(self, cfg: Any, dims: Any, world: Any, inputs: Any) -> None:
        super().__init__(cfg, cfg, dims, world, inputs=inputs)  # ReplicaSteps's, then ours
        self._group_data = (world.rank, world.world_size)  # the mesh's data coordinates
        # groups sharing a machine take GPUs of their own (Lightning's default: cuda:0 ..)
        self.parallel_devices = parallel_devices(world, first_gpu(cfg, world.devices))

    def setup_environment(self) -> None:
        # the mesh is the group's; the data rank is the group's share of all groups' processes
        # (framework.replica_groups.data_parallel), which the mesh's check would refuse
        across = self.inputs.data_parallel
        self.inputs = replace(self.inputs, data_parallel=self._group_data)
        try:
            super().setup_environment()
        finally:
            self.inputs = replace(self.inputs, data_parallel=across)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        rank, size = self.inputs.data_parallel
        return {"num_replicas": size, "rank": rank}
