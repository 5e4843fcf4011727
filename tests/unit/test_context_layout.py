"""Context parallel on the one mesh with expert parallel: cp and ep take disjoint factors of
fsdp; for every rank of an 8-process job (torch's fake process group) the cp ranks read the same
batch, the ep ranks hold different batches, and the views the gradients and the routers' counts
use have the sizes the arithmetic says."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from framework.errors import ConfigError
from framework.parallel.dims import ParallelDims


def ranks_of(mesh) -> list[int]:
    return sorted(int(r) for r in mesh.mesh.flatten())


@pytest.mark.parametrize(
    "dims",
    [ParallelDims(dp=2, fsdp=4, ep=2, cp=2), ParallelDims(pp=2, fsdp=4, cp=2)],
    ids=["dp2-fsdp4-ep2-cp2", "pp2-fsdp4-cp2"],
)
def test_cp_and_ep_views_agree_with_the_data_coordinates(dims):
    for rank in range(dims.world_size):
        dist.init_process_group("fake", rank=rank, world_size=dims.world_size)
        try:
            mesh = dims.build_mesh("cpu")
            data = mesh["data"]
            assert (data.get_local_rank(), data.size()) == dims.data_parallel(rank)
            cp = ranks_of(mesh["cp"])
            assert len(cp) == dims.cp and rank in cp
            # a cp group reads one batch, on neighbouring ranks
            assert {dims.data_parallel(r) for r in cp} == {dims.data_parallel(rank)}
            assert cp == list(range(cp[0], cp[0] + dims.cp))
            assert mesh["tokens"].size() == dims.shard_size
            if dims.ep > 1:
                ep = ranks_of(mesh["ep"])
                assert len({dims.data_parallel(r) for r in ep}) == dims.ep, "different batches"
                efsdp = ranks_of(mesh["efsdp"])
                assert len(efsdp) * dims.ep == dims.shard_size
                assert set(efsdp) & set(ep) == {rank} and set(cp) <= set(efsdp)
            if dims.pp > 1:  # a pipeline column keeps its cp coordinate
                pp = ranks_of(mesh["pp"])
                assert {r % dims.cp for r in pp} == {rank % dims.cp}
        finally:
            dist.destroy_process_group()


def test_cp_x_ep_must_divide_fsdp():
    assert ParallelDims.fit({"fsdp": -1, "ep": 2, "cp": 2}, 4) == ParallelDims(fsdp=4, ep=2, cp=2)
    assert ParallelDims.fit({"fsdp": -1, "ep": 2, "cp": -1}, 8).cp == 4  # all that ep leaves
    with pytest.raises(ConfigError) as err:
        ParallelDims.fit({"fsdp": -1, "ep": 2, "cp": 2}, 2)
    assert "fsdp / ep = 1 left after strategy.ep=2" in str(err.value)
    assert "Valid choices: 1." in str(err.value)
