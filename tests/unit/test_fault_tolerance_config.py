"""`strategy.fault_tolerance=torchft` settings, checked in the `fw` process: refused before
launch under a strategy that has no replica groups. (The run with replica groups is
tests/distributed/test_fault_tolerance.py.)"""

from __future__ import annotations

import pytest

from tests.conftest import QUIET, refused


@pytest.mark.parametrize("strategy", ["fsdp", "zero2"])
def test_torchft_under_another_strategy_names_the_one_that_has_it(
    strategy, workdir, monkeypatch, capsys
):
    args = ["task=digits", f"strategy={strategy}", "strategy.fault_tolerance=torchft", *QUIET]
    err = refused(args, workdir, monkeypatch, capsys)
    assert err.startswith(
        f"error: strategy.fault_tolerance=torchft: no such key for strategy={strategy}; "
        "only strategy=ddp has it. Valid choices: kind, backend,"
    ), err


def test_a_key_of_several_other_strategies_names_them_all(workdir, monkeypatch, capsys):
    err = refused(["task=digits", "strategy=ddp", "strategy.tp=2"], workdir, monkeypatch, capsys)
    assert "strategy.tp=2: no such key for strategy=ddp; only strategy=expert, fsdp, " in err, err
    assert "fsdp_tp, pipeline, tensor have it. Valid choices: kind, backend," in err, err
