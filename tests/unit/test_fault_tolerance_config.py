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
