"""`strategy.fault_tolerance=torchft` settings, checked in the `fw` process: refused before
launch under a strategy that has no replica groups; `fw check` predicts a torchft job without
contacting its lighthouse. (The run with replica groups and the other refusals are in
tests/distributed/test_fault_tolerance.py.)"""

from __future__ import annotations

import socket

import pytest

from tests.conftest import QUIET, refused

TORCHFT = [
    "task=digits",
    "strategy=ddp",
    "trainer.devices=1",
    "strategy.fault_tolerance=torchft",
    "strategy.replica_groups=2",
    *QUIET,
]


def test_torchft_under_another_strategy_names_those_that_have_it(workdir, monkeypatch, capsys):
    args = ["task=digits", "strategy=zero2", "strategy.fault_tolerance=torchft", *QUIET]
    err = refused(args, workdir, monkeypatch, capsys)
    assert err.startswith(
        "error: strategy.fault_tolerance=torchft: no such key for strategy=zero2; "
        "only strategy=ddp, expert, fsdp, fsdp_tp, pipeline, tensor have it. Valid choices: "
        "kind, backend,"
    ), err


@pytest.mark.parametrize(
    ("strategy", "degree"), [("tensor", "tp=2"), ("pipeline", "pp=2"), ("expert", "ep=2")]
)
def test_torchft_with_a_degree_besides_fsdp_is_refused(
    strategy, degree, workdir, monkeypatch, capsys
):
    """torchft replica groups shard with fsdp only (HSDP): tp, pp, ep (and dp, cp) refused
    before launch, whatever the lighthouse."""
    args = [
        "task=digits",
        f"strategy={strategy}",
        "trainer.devices=2",
        "strategy.fault_tolerance=torchft",
        "strategy.replica_groups=2",
        f"strategy.lighthouse=127.0.0.1:{closed_port()}",
        *QUIET,
    ]
    err = refused(args, workdir, monkeypatch, capsys)
    assert err.startswith(
        f"error: strategy.{degree}: strategy.fault_tolerance=torchft shards each replica "
        "group with fsdp over its processes only"
    ), err


def test_a_key_of_several_other_strategies_names_them_all(workdir, monkeypatch, capsys):
    err = refused(["task=digits", "strategy=ddp", "strategy.tp=2"], workdir, monkeypatch, capsys)
    assert "strategy.tp=2: no such key for strategy=ddp; only strategy=expert, fsdp, " in err, err
    assert "fsdp_tp, pipeline, tensor have it. Valid choices: kind, backend," in err, err


def closed_port() -> int:
    """A port on this machine that nobody listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_fw_check_predicts_a_torchft_job_without_its_lighthouse_up(workdir, monkeypatch, capsys):
    """fw check (and fw plan, through the same validation) does not contact the lighthouse:
    only `fw train` needs it up (its refusal: tests/distributed/test_fault_tolerance.py)."""
    from framework.cli import main

    monkeypatch.chdir(workdir)
    args = [*TORCHFT, f"strategy.lighthouse=127.0.0.1:{closed_port()}"]
    code = main(["check", *args])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "ddp x 1, 1 processes" in out.out, out.out


def test_fw_check_still_refuses_a_lighthouse_that_is_no_address(workdir, monkeypatch, capsys):
    from framework.cli import main

    monkeypatch.chdir(workdir)
    code = main(["check", *TORCHFT, "strategy.lighthouse=nohost"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "strategy.lighthouse=nohost: not an address of the form HOST:PORT" in err, err


def test_fw_plan_counts_the_all_reduce_across_groups_of_several_processes():
    from framework.plugins import capability, load_plugin, typed_config
    from framework.world import World

    ddp = load_plugin("strategy", "ddp", "strategy.kind")
    traffic = capability(ddp, "data_traffic")
    torchft = typed_config(ddp, {"kind": "ddp", "fault_tolerance": "torchft"})
    plain = typed_config(ddp, {"kind": "ddp"})
    assert traffic(plain, World(2, 2, 1, "cpu"), 10, 99) == 20
    assert traffic(torchft, World(1, 1, 1, "cpu"), 10, 99) == 20  # across the groups only
    assert traffic(torchft, World(2, 2, 1, "cpu"), 10, 99) == 40  # inside, then across
    fsdp = load_plugin("strategy", "parallel", "strategy.kind")
    sharded = capability(fsdp, "data_traffic")
    fsdp_torchft = typed_config(
        fsdp, {"kind": "parallel", "fsdp": -1, "fault_tolerance": "torchft"}
    )
    fsdp_plain = typed_config(fsdp, {"kind": "parallel", "fsdp": -1})
    assert sharded(fsdp_plain, World(2, 2, 1, "cpu"), 10, 99) == 60  # FSDP2's 3 x 2 shards
    assert sharded(fsdp_torchft, World(2, 2, 1, "cpu"), 10, 99) == 80  # + its shard across


def torchft_settings(**given):
    """strategy=ddp's settings with torchft, as composed."""
    from framework.strategies.ddp import Config

    return Config(fault_tolerance="torchft", lighthouse="127.0.0.1:29510", **given)


def cuda_world(devices: int):
    from framework.world import World

    return World(world_size=devices, devices=devices, num_nodes=1, accelerator="cuda")


@pytest.mark.parametrize("devices", [1, 2])
def test_replica_groups_on_one_machine_take_gpus_of_their_own(devices):
    """Groups started on one machine (strategy.groups_per_machine) each take their own
    trainer.devices GPUs: rank r of group g runs on GPU g x devices + r, so no two members of
    torchft's NCCL group of rank r share a GPU (NCCL refuses, and no step would commit)."""
    from framework.parallel.transforms import ModelTransforms
    from framework.strategies import ddp
    from framework.strategy_base import StrategyInputs

    inputs = StrategyInputs(transforms=ModelTransforms(False, False))
    world = cuda_world(devices)
    placed = {}
    for group in range(3):
        cfg = torchft_settings(replica_groups=3, replica_group=group, groups_per_machine=3)
        strategy = ddp.build(cfg, world, inputs)
        if devices == 1:
            placed[group] = [strategy.root_device]
        else:
            placed[group] = strategy.parallel_devices
    gpus = [d.index for group in range(3) for d in placed[group]]
    assert gpus == list(range(3 * devices)), placed
    assert all(d.type == "cuda" for group in placed.values() for d in group)


@pytest.mark.parametrize("devices", [1, 2])
def test_sharded_replica_groups_on_one_machine_take_gpus_of_their_own(devices):
    """The same under strategy=fsdp: each group's FSDP2 processes (Lightning's
    parallel_devices, by local rank) are GPUs g x devices .. g x devices + devices - 1, not
    every group's cuda:0 .. devices - 1."""
    from framework.parallel.transforms import ModelTransforms
    from framework.strategies import parallel
    from framework.strategy_base import StrategyInputs

    world = cuda_world(devices)
    placed = {}
    for group in range(3):
        cfg = parallel.Config(
            kind="parallel",
            fsdp=-1,
            fault_tolerance="torchft",
            lighthouse="127.0.0.1:29510",
            replica_groups=3,
            replica_group=group,
            groups_per_machine=3,
        )
        inputs = StrategyInputs(
            transforms=ModelTransforms(False, False),
            data_parallel=parallel.data_parallel(cfg, world),
        )
        strategy = parallel.build(cfg, world, inputs)
        placed[group] = strategy.parallel_devices
        assert strategy.root_device == placed[group][0]  # local rank 0's
    gpus = [d.index for group in range(3) for d in placed[group]]
    assert gpus == list(range(3 * devices)), placed
    assert all(d.type == "cuda" for group in placed.values() for d in group)


def test_groups_that_would_share_a_gpu_are_refused_before_launch(monkeypatch):
    """The check of every NCCL group's (machine, GPU) members (framework.parallel.nccl_rules),
    with the GPU choice planted back to what it was (every group from cuda:0)."""
    from framework import replica_groups
    from framework.errors import ConfigError

    cfg = torchft_settings(replica_groups=2, groups_per_machine=2)
    replica_groups.validate(cfg, cuda_world(2))  # groups 0 and 1 on GPUs 0-1 and 2-3
    monkeypatch.setattr(replica_groups, "first_gpu", lambda cfg, devices, group=None: 0)
    with pytest.raises(ConfigError) as err:
        replica_groups.validate(cfg, cuda_world(2))
    assert (
        "replica groups would share a GPU: torchft's group of rank 0: members 0 and 1 would "
        "both run on GPU 0 of machine 0"
    ) in str(err.value)


@pytest.mark.parametrize(
    ("given", "visible", "says"),
    [
        ({"groups_per_machine": 3}, 8, "more than the strategy.replica_groups=2 that exist"),
        ({"groups_per_machine": 2}, 6, "2 groups of trainer.devices=4 GPUs need 8 GPUs on this "),
    ],
)
def test_groups_per_machine_beyond_the_groups_or_the_gpus_is_refused(
    given, visible, says, monkeypatch
):
    from framework import world
    from framework.errors import ConfigError
    from framework.replica_groups import validate

    monkeypatch.setattr(world, "cuda_device_count", lambda: visible)
    with pytest.raises(ConfigError, match="strategy.groups_per_machine") as err:
        validate(torchft_settings(replica_groups=2, **given), cuda_world(4))
    assert says in str(err.value)


def test_a_second_groups_process_on_a_claimed_gpu_is_refused_naming_the_first(tmp_path):
    """Without strategy.groups_per_machine, two commands on one machine take the same GPUs:
    the second group's process is refused when it starts (a per-GPU claim on the machine),
    where NCCL would refuse torchft's group at every step and no step would commit."""
    from framework.replica_groups import claim_gpu

    first = claim_gpu("GPU-1234", "replica group 0's rank 0 (pid 1)", str(tmp_path))
    with pytest.raises(RuntimeError) as err:
        claim_gpu("GPU-1234", "replica group 1's rank 0 (pid 2)", str(tmp_path))
    assert "this GPU (GPU-1234) already runs replica group 0's rank 0 (pid 1)" in str(err.value)
    assert "strategy.groups_per_machine" in str(err.value)
    other = claim_gpu("GPU-5678", "replica group 1's rank 0 (pid 2)", str(tmp_path))
    first.close()  # the first process ended: the GPU is free again
    claim_gpu("GPU-1234", "replica group 1's rank 0 (pid 2)", str(tmp_path)).close()
    other.close()
