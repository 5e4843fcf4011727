"""Registers every schema in Hydra's ConfigStore under `schema/<group>/<name>`.

A YAML option of a group selects its schema with `- /schema/<group>/<name>@_here_` in its
defaults list, so every value it sets (and every command-line override) is type-checked.
Plugin schemas are discovered from the plugin packages: adding a plugin edits nothing here.
"""

from __future__ import annotations

import importlib

from hydra.core.config_store import ConfigStore

from framework.config import schema
from framework.plugins import FAMILIES, builtin_kinds

CORE_SCHEMAS = {
    "train": schema.TrainConfig,
    "task": schema.TaskConfig,
    "trainer": schema.TrainerConfig,
}


def plugin_schemas() -> dict[tuple[str, str], type]:
    """(group, kind) -> Config dataclass of every built-in plugin."""
    found = {}
    for family, package in FAMILIES.items():
        for kind in builtin_kinds(family):
            module = importlib.import_module(f"{package}.{kind}")
            if hasattr(module, "Config"):
                found[(family, kind)] = module.Config
    return found


def register() -> None:
    """Store all schemas (idempotent: re-storing replaces the same entries)."""
    cs = ConfigStore.instance()
    for name, node in CORE_SCHEMAS.items():
        cs.store(group="schema", name=name, node=node)
    for (group, kind), node in plugin_schemas().items():
        cs.store(group=f"schema/{group}", name=kind, node=node)
