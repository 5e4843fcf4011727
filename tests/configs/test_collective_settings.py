"""The collective settings (`strategy.backend`, `strategy.timeout_s`) are one schema shared by
every strategy that has them, so a bad value is refused before launch under every strategy
option: exit code 2, one line naming the key, the value and the valid choices, nothing written."""

from __future__ import annotations

import dataclasses

import pytest

from framework.cli import main
from framework.config.compose import group_options
from framework.config.schema import CollectiveSettings
from framework.plugins import builtin_kinds, load_plugin

OPTIONS = group_options("strategy")


def refused(args: list[str], tmp_path, monkeypatch, capsys) -> str:
    monkeypatch.chdir(tmp_path)
    code = main(["train", *args, "run.dir=run"])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert err.startswith("error: ") and len(err.splitlines()) == 1 and "Traceback" not in err
    assert list(tmp_path.iterdir()) == [], "nothing written"
    return err


def test_every_strategy_with_collective_settings_takes_them_from_one_schema():
    for kind in builtin_kinds("strategy"):
        schema = load_plugin("strategy", kind, "strategy.kind").Config
        names = {f.name for f in dataclasses.fields(schema)}
        if names & {"backend"}:
            assert issubclass(schema, CollectiveSettings), kind


@pytest.mark.parametrize("option", OPTIONS)
def test_a_bad_backend_or_timeout_is_refused_under_every_strategy(
    option, tmp_path, monkeypatch, capsys
):
    from framework.config.compose import compose_config

    strategy = compose_config([f"strategy={option}"]).strategy
    assert "timeout_s" in strategy, f"strategy={option} has no collective timeout"
    if "backend" in strategy:
        err = refused([f"strategy={option}", "strategy.backend=mpi"], tmp_path, monkeypatch, capsys)
        assert "strategy.backend=mpi: not a valid choice. Valid choices: null, gloo, nccl." in err
    err = refused([f"strategy={option}", "strategy.timeout_s=0"], tmp_path, monkeypatch, capsys)
    assert "strategy.timeout_s=0: must be at least 1" in err
