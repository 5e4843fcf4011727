"""`launcher=ray` on CUDA, without a GPU cluster: every node takes trainer.devices ranks (one
bundle of that many GPUs per node, each on a node of its own), and a placement that gives a node
another count is refused before any rank runs, where Lightning would fail on that node (it asks
every node for trainer.devices GPUs). The CPU keeps one bundle per rank placed by
launcher.strategy. (Jobs on a real two-node Ray cluster: tests/distributed/test_ray.py.)"""

from __future__ import annotations

import pytest

from framework.launchers.ray.ranks import UnevenNodes, placement, rank_envs
from framework.launchers.ray.settings import Config
from framework.world import World


def world(accelerator: str) -> World:
    return World(world_size=8, devices=4, num_nodes=2, accelerator=accelerator)


def test_a_cuda_job_takes_one_bundle_of_its_gpus_per_node():
    bundles, strategy, slots = placement(Config(strategy="PACK", cpus_per_rank=2), world("cuda"))
    assert bundles == [{"CPU": 8.0, "GPU": 4.0}] * 2
    assert strategy == "STRICT_SPREAD", "two bundles on one node would give it 8 ranks"
    assert slots == [0, 0, 0, 0, 1, 1, 1, 1]


def test_a_cpu_job_keeps_a_bundle_per_rank_placed_as_asked():
    bundles, strategy, slots = placement(Config(strategy="PACK", cpus_per_rank=2), world("cpu"))
    assert bundles == [{"CPU": 2.0}] * 8 and strategy == "PACK" and slots == list(range(8))


def places(counts: dict[str, int]) -> list[dict]:
    return [
        {"node": node, "ip": "10.0.0.1", "pid": 1, "gpus": [str(i)], "port": 29500}
        for node, n in counts.items()
        for i in range(n)
    ]


def test_a_node_given_other_than_trainer_devices_ranks_is_refused_on_cuda():
    cfg = Config()
    uneven = places({"node-a-xxxxxx": 5, "node-b-xxxxxx": 3})  # PACK on a partly busy cluster
    with pytest.raises(UnevenNodes, match="placed 5 on node node-a-x, 3 on node node-b-x"):
        rank_envs(uneven, ["node-a-xxxxxx", "node-b-xxxxxx"], cfg, world("cuda"), 0)
    envs = rank_envs(uneven, ["node-a-xxxxxx", "node-b-xxxxxx"], cfg, world("cpu"), 0)
    assert [e["LOCAL_WORLD_SIZE"] for e in envs] == ["5"] * 5 + ["3"] * 3, "the CPU runs it"
    even = places({"node-a-xxxxxx": 4, "node-b-xxxxxx": 4})
    envs = rank_envs(even, ["node-a-xxxxxx", "node-b-xxxxxx"], cfg, world("cuda"), 0)
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["0,1,2,3"] * 8


def test_gloo_and_nccl_settings_reach_every_rank(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "ens5")
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ens5")
    envs = rank_envs(
        places({"node-a": 4, "node-b": 4}), ["node-a", "node-b"], Config(), world("cuda"), 0
    )
    assert all(e["GLOO_SOCKET_IFNAME"] == e["NCCL_SOCKET_IFNAME"] == "ens5" for e in envs)
