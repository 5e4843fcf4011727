"""The optional members of a strategy plugin (framework.plugins.StrategyCapabilities): a module
without them gets the documented defaults, and the built-in plugins' answers are what `fw
check`, `fw plan`, validation and a resume's messages show."""

from __future__ import annotations

import types

import pytest

from framework.context import config_changes
from framework.plugins import (
    StrategyCapabilities,
    capability,
    describe_strategy,
    load_plugin,
    typed_config,
)
from framework.world import World


def test_a_plugin_without_capabilities_gets_the_defaults():
    bare = types.ModuleType("bare")
    cfg = types.SimpleNamespace(kind="my.bare")
    world = World(4, 4, 1, "cuda")
    assert capability(bare, "describe")(cfg, world) == "my.bare x 4"
    assert capability(bare, "describe")(cfg, None) == "my.bare"
    assert capability(bare, "mesh_dims")(cfg, world) is None
    assert capability(bare, "saves_async")(cfg, world) is False
    assert capability(bare, "data_traffic")(cfg, world, 10, 99) == 20
    assert capability(bare, "data_overlap")(cfg, world) == 1.0
    assert capability(bare, "data_collectives")(cfg, world, 10, 99) is None  # DDP's buckets
    replica = object()
    assert capability(bare, "model_states")(cfg, world, replica, "32-true") == (replica, None)
    with pytest.raises(AttributeError):
        capability(bare, "no_such_capability")
    assert "describe" in vars(StrategyCapabilities)


def test_the_builtin_answers():
    world = World(8, 8, 1, "cuda")
    zero = load_plugin("strategy", "deepspeed", "strategy.kind")
    stage3 = typed_config(zero, {"kind": "deepspeed", "stage": 3})
    assert capability(zero, "describe")(stage3, world) == "zero3 x 8"
    assert capability(zero, "data_traffic")(stage3, world, 10, 80) == 3 * 10 * 8
    stage1 = typed_config(zero, {"kind": "deepspeed", "stage": 1})
    assert capability(zero, "data_traffic")(stage1, world, 10, 80) == 2 * 80
    assert not capability(zero, "saves_async")(stage1, world)
    overlap = capability(zero, "data_overlap")
    # the parameters' all-gather follows the optimizer step; on the CPU overlap_comm is off
    assert (overlap(stage1, world), overlap(stage3, world)) == (0.5, 1.0)
    calls = capability(zero, "data_collectives")
    # a bucket of gradients reduced, the overflow check, the norm, a bucket of parameters gathered
    assert calls(stage1, world, 10, 80) == 4
    assert calls(stage1, world, 10, 4 * stage1.bucket_size + 1) == 2 * 2 + 2
    assert calls(stage3, world, 10, 80) is None
    cpu = World(8, 8, 1, "cpu")
    assert (overlap(stage1, cpu), overlap(stage3, cpu)) == (0.0, 0.0)
    off = {"zero_optimization": {"overlap_comm": False}}
    told = typed_config(zero, {"kind": "deepspeed", "stage": 3, "deepspeed_config": off})
    assert overlap(told, world) == 0.0  # the user's own DeepSpeed setting wins
    diloco = load_plugin("strategy", "diloco", "strategy.kind")
    rounds = typed_config(diloco, {"kind": "diloco"})
    assert capability(diloco, "data_overlap")(rounds, world) == 0.0  # a blocking round end
    mesh = load_plugin("strategy", "parallel", "strategy.kind")
    layout = typed_config(mesh, {"kind": "parallel", "pp": 2, "fsdp": -1, "tp": 2})
    dims = capability(mesh, "mesh_dims")(layout, world)
    assert (dims.pp, dims.fsdp, dims.tp) == (2, 2, 2)
    assert capability(mesh, "describe")(layout, world) == "pp=2 x fsdp=2 x tp=2"
    assert capability(mesh, "saves_async")(layout, world)


def test_a_resume_into_another_strategy_names_both_as_their_plugins_describe_them():
    zero2 = {"strategy": {"kind": "deepspeed", "stage": 2}, "seed": 1}
    fsdp_tp = {"strategy": {"kind": "parallel", "fsdp": -1, "tp": 2}, "seed": 1}
    gone = {"strategy": {"kind": "not_installed.plugin"}, "seed": 1}
    changes = config_changes(zero2, fsdp_tp, describe_strategy)[1]
    assert changes == ["strategy: zero2 -> parallel(fsdp=-1, tp=2)"]
    old_fields = {"strategy": {"kind": "deepspeed", "stage": 3, "field_since_removed": 1}}
    assert describe_strategy(old_fields) == "deepspeed"
    assert config_changes(fsdp_tp, gone, describe_strategy)[1] == [
        "strategy: parallel(fsdp=-1, tp=2) -> not_installed.plugin"
    ]


def test_fw_plans_candidates_are_what_the_strategy_plugins_propose(monkeypatch):
    """`fw plan` tries the layouts each strategy plugin proposes (`plan_candidates`), in the
    family's order, and nothing else: a plugin that proposes another layout adds it."""
    from framework.plugins import builtin_kinds
    from framework.preflight.planner import layouts

    proposed = [
        candidate
        for kind in builtin_kinds("strategy", ordered=True)
        for candidate in capability(load_plugin("strategy", kind, "k"), "plan_candidates")(8, 8)
    ]
    assert layouts(8, 8) == proposed and ("ddp", ["strategy=ddp"]) in proposed
    ddp = load_plugin("strategy", "ddp", "k")
    monkeypatch.setattr(ddp, "plan_candidates", lambda gpus, tp: [("ddp-wide", ["strategy=ddp"])])
    assert ("ddp-wide", ["strategy=ddp"]) in layouts(8, 8)
    assert ("ddp", ["strategy=ddp"]) not in layouts(8, 8)
