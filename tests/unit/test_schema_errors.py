"""One translation of OmegaConf's errors (config.fields.schema_error) and one field walker
(config.fields.check_fields) serve the composed job config, a plugin's typed config and the
sweep settings alike: the same one-line ConfigError for an unknown key, a mistyped value, a
value outside its choices or bounds, at any depth."""

from __future__ import annotations

import types
from dataclasses import dataclass

import pytest

from framework.config.compose import CONF_DIR
from framework.config.fields import doc
from framework.errors import ConfigError
from framework.plugins import load_plugin, typed_config
from framework.sweep.config import load


@dataclass
class Inner:
    """A nested settings block."""

    mode: str = doc("a", "A choice.", ("a", "b"))


@dataclass
class Settings:
    """An out-of-tree plugin's schema (Hydra does not know it)."""

    kind: str = doc("my.plugin", "Plugin.")
    size: int = doc(1, "A bounded number.", min=1)
    inner: Inner = doc(Inner(), "Nested.")


def refusal(call) -> str:
    with pytest.raises(ConfigError) as err:
        call()
    return str(err.value)


def test_a_plugin_config_outside_hydra_is_refused_as_a_composed_one():
    plugin = types.SimpleNamespace(Config=Settings)
    typed = typed_config(plugin, {"kind": "my.plugin", "size": 3}, "strategy")
    assert typed.size == 3 and typed.inner.mode == "a"
    assert refusal(lambda: typed_config(plugin, {"sise": 3}, "strategy")).startswith(
        "strategy.sise=3: no such key. Did you mean 'size'?"
    )
    assert refusal(lambda: typed_config(plugin, {"size": "big"}, "strategy")) == (
        "strategy.size=big: value 'big' of type 'str' could not be converted to Integer."
    )
    assert refusal(lambda: typed_config(plugin, {"size": 0}, "strategy")) == (
        "strategy.size=0: must be at least 1."
    )
    nested = refusal(lambda: typed_config(plugin, {"inner": {"mode": "c"}}, "strategy"))
    assert nested == "strategy.inner.mode=c: not a valid choice. Valid choices: a, b."


def test_a_builtin_nested_setting_is_checked_when_typed():
    diloco = load_plugin("strategy", "diloco", "strategy.kind")
    node = {"kind": "diloco", "outer_optimizer": {"momentum": 2.0}}
    assert refusal(lambda: typed_config(diloco, node, "strategy")).startswith(
        "strategy.outer_optimizer.momentum=2.0: must be at most 1"
    )


def test_the_sweep_settings_are_refused_the_same_way():
    unknown = refusal(lambda: load(["sweep.samplr=tpe"], [CONF_DIR]))
    assert unknown.startswith("sweep.samplr=?: no such key. Did you mean 'sampler'?")
    assert refusal(lambda: load(["sweep.seed=abc"], [CONF_DIR])) == (
        "sweep.seed=?: value 'abc' of type 'str' could not be converted to Integer."
    )
    assert refusal(lambda: load(["sweep.sampler=nope"], [CONF_DIR])) == (
        "sweep.sampler=nope: not a valid choice. Valid choices: tpe, random."
    )
