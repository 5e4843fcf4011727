"""ParallelDims: degrees fitted to the processes, and the one mesh whose named views agree with
the coordinates the worker computes before any process group exists (checked for every rank of
an 8-process job with torch's fake process group, including the expert-parallel layout)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from framework.errors import ConfigError
from framework.parallel.dims import ParallelDims


def test_one_degree_takes_the_rest():
    assert ParallelDims.fit({"pp": 2, "fsdp": -1, "tp": 2}, 8) == ParallelDims(2, 1, 2, 2, 1)
    assert ParallelDims.fit({"fsdp": -1, "ep": -1}, 4).ep == 4  # ep borrows all of fsdp


@pytest.mark.parametrize(
    ("degrees", "world", "message"),
    [
        ({"pp": -1, "tp": -1}, 4, "strategy.tp=-1: only one degree may be -1"),
        ({"pp": 3, "fsdp": -1}, 4, "the other degrees multiply to 3, which does not divide the 4"),
        ({"pp": 2, "tp": 3}, 4, "the degrees multiply to 6, but the job has 4 processes"),
        ({"tp": 0}, 4, "strategy.tp=0: must be at least 1, or -1 for the rest"),
        ({"fsdp": 2, "tp": 2, "ep": 4}, 4, "borrows its ranks from the fsdp degree (2)"),
        ({"fsdp": 4, "ep": 3}, 4, "Valid choices: 1, 2, 4"),
    ],
)
def test_degrees_that_do_not_fit_are_config_errors(degrees, world, message):
    with pytest.raises(ConfigError) as err:
        ParallelDims.fit(degrees, world)
    assert message in str(err.value)


def ranks_of(mesh) -> list[int]:
    return sorted(int(r) for r in mesh.mesh.flatten())


@pytest.mark.parametrize(
    "dims",
    [ParallelDims(pp=2, dp=1, fsdp=2, tp=2), ParallelDims(pp=1, dp=2, fsdp=4, tp=1, ep=2)],
    ids=["pp2-fsdp2-tp2", "dp2-fsdp4-ep2"],
)
def test_the_mesh_views_match_the_arithmetic_coordinates(dims):
    for rank in range(dims.world_size):
        dist.init_process_group("fake", rank=rank, world_size=dims.world_size)
        try:
            mesh = dims.build_mesh("cpu")
            coords = dims.coordinates(rank)
            for name in ("pp", "dp", "fsdp", "tp"):
                assert mesh[name].size() == getattr(dims, name)
                assert mesh[name].get_local_rank() == coords[name], (rank, name)
            data = mesh["data"]
            assert (data.get_local_rank(), data.size()) == dims.data_parallel(rank)
            # ranks that read the same data: one tensor-parallel group x one pipeline column
            same = {
                r
                for r in range(dims.world_size)
                if dims.data_parallel(r) == dims.data_parallel(rank)
            }
            assert len(same) == dims.pp * dims.tp
            assert rank not in ranks_of(data) or set(ranks_of(data)).isdisjoint(same - {rank})
            if dims.ep > 1:
                ep = mesh["ep"]
                assert ep.size() == dims.ep
                # ep borrows fsdp ranks: its ranks share pp, dp and tp with this one
                for name in ("pp", "dp", "tp"):
                    assert {dims.coordinates(r)[name] for r in ranks_of(ep)} == {coords[name]}
                assert mesh["efsdp"].size() * dims.ep == dims.data_size
        finally:
            dist.destroy_process_group()
