"""Finding plugins: a config node's `kind` names a module; the module provides the behaviour.

A strategy, logger, callback or launcher plugin is one module with:
  - `Config`: the dataclass schema of its config node (registered in Hydra's ConfigStore),
  - `validate(cfg, world)`: optional checks run in the `fw` process before any worker starts,
  - `build(cfg, ...)`: the object it contributes, built inside each worker.
A `kind` without a dot is looked up in the package of that plugin family (e.g. `ddp` is
`framework.strategies.ddp`); a dotted `kind` is imported as is, so plugins can live outside.
"""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType

from framework.errors import ConfigError

FAMILIES = {
    "strategy": "framework.strategies",
    "logger": "framework.loggers",
    "callbacks": "framework.callbacks",
    "launcher": "framework.launchers",
}


def builtin_kinds(family: str) -> list[str]:
    """Names of the plugin modules shipped with the framework for one family."""
    package = importlib.import_module(FAMILIES[family])
    return sorted(
        m.name for m in pkgutil.iter_modules(package.__path__) if not m.name.startswith("_")
    )


def load_plugin(family: str, kind: str, key: str) -> ModuleType:
    """The module implementing `kind`, or a ConfigError naming `key` and the valid kinds."""
    name = kind if "." in kind else f"{FAMILIES[family]}.{kind}"
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as err:
        if err.name is not None and name.startswith(err.name):
            raise ConfigError(
                key, kind, f"no {family} plugin of that kind", builtin_kinds(family)
            ) from None
        raise
    if not hasattr(module, "build"):
        raise ConfigError(
            key, kind, f"module {name} has no build() function", builtin_kinds(family)
        )
    return module
