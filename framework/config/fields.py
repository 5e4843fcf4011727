"""Helpers for schema fields that carry their own one-line description, valid choices and bounds.

Bounds are declared next to the field (`doc(1, "...", min=1)`) and checked for every group at
compose time (framework.config.validate), before anything starts; `None` always passes a bound
(an optional field that is unset). `check_fields` is the one walker that checks them, over a
composed node or a plugin's typed config alike; `schema_error` is the one translation of
OmegaConf's errors about a typed node into a ConfigError.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from framework.errors import ConfigError


def doc(
    default: Any,
    help: str,
    choices: Sequence[Any] | None = None,
    *,
    min: float | None = None,
    max: float | None = None,
    above: float | None = None,
) -> Any:
    """A dataclass field with a description (shown by `fw config`), optional valid choices and
    optional numeric bounds: `min <= value <= max`, `value > above`."""
    metadata: dict[str, Any] = {"help": help}
    if choices is not None:
        metadata["choices"] = tuple(choices)
    bounds = {k: v for k, v in (("min", min), ("max", max), ("above", above)) if v is not None}
    if bounds:
        metadata["bounds"] = bounds
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: _copy(default), metadata=metadata)
    if dataclasses.is_dataclass(default) and not isinstance(default, type):
        return dataclasses.field(
            default_factory=lambda: dataclasses.replace(default), metadata=metadata
        )
    return dataclasses.field(default=default, metadata=metadata)


def _copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value


def field_help(schema: type, name: str) -> str:
    """The one-line description of a schema field ('' when it has none)."""
    for f in dataclasses.fields(schema):
        if f.name == name:
            return f.metadata.get("help", "")
    return ""


def field_choices(schema: type, name: str) -> tuple[Any, ...] | None:
    """The valid values declared for a schema field, or None when any value of its type is fine."""
    for f in dataclasses.fields(schema):
        if f.name == name:
            return f.metadata.get("choices")
    return None


def out_of_bounds(schema: type, name: str, value: Any) -> str | None:
    """What is wrong with `value` against the field's declared bounds, or None."""
    bounds = next(
        (f.metadata.get("bounds") for f in dataclasses.fields(schema) if f.name == name), None
    )
    if (
        not bounds
        or value is None
        or isinstance(value, bool)
        or not isinstance(value, (int, float))
    ):
        return None
    if "min" in bounds and value < bounds["min"]:
        return f"must be at least {bounds['min']}"
    if "above" in bounds and value <= bounds["above"]:
        return f"must be greater than {bounds['above']}"
    if "max" in bounds and value > bounds["max"]:
        return f"must be at most {bounds['max']}"
    return None


def check_fields(node: Any, prefix: str = "") -> None:
    """Every field holds one of its declared choices and lies within its declared bounds, at any
    depth, and a typed node holds no key its schema lacks (a `+key` added to it). `node` is a
    composed DictConfig or a dataclass instance (a plugin's typed config, whose schema Hydra
    may not know); `prefix` is its place in the job config, ending in a dot (e.g. `strategy.`)."""
    schema = _schema(node)
    for key, value, child in _entries(node):
        path = f"{prefix}{key}"
        if dataclasses.is_dataclass(schema):
            names = [f.name for f in dataclasses.fields(schema)]
            if key not in names:
                hint = (
                    f"Values of your own go under `extra`: +extra.{key}=..." if not prefix else None
                )
                raise ConfigError(path, value, "no such key", names, hint=hint, near=str(key))
            check_value(schema, key, value, path)
        if child is not None:
            check_fields(child, f"{path}.")


def check_value(schema: type, name: str, value: Any, path: str) -> None:
    """ConfigError naming `path` when `value` is not one of the field's choices or out of its
    bounds."""
    choices = field_choices(schema, name)
    if choices is not None and value not in choices:
        raise ConfigError(
            path, value, "not a valid choice", ["null" if c is None else c for c in choices]
        )
    problem = out_of_bounds(schema, name, value)
    if problem:
        raise ConfigError(path, value, problem)


def _schema(node: Any) -> Any:
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        return type(node)
    from omegaconf import DictConfig, OmegaConf

    return OmegaConf.get_type(node) if isinstance(node, DictConfig) else None


def _entries(node: Any) -> list[tuple[str, Any, Any]]:
    """(key, value, child node to walk or None) of a DictConfig's keys or a dataclass's fields."""
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        out = []
        for f in dataclasses.fields(node):
            value = getattr(node, f.name)
            child = value if dataclasses.is_dataclass(value) else None
            out.append((f.name, value, child))
        return out
    from omegaconf import DictConfig

    if not isinstance(node, DictConfig):
        return []
    out = []
    for key in node:
        inner = node._get_node(key)
        value = inner._value() if inner is not None else None
        out.append((str(key), value, inner if isinstance(inner, DictConfig) else None))
    return out


def schema_error(
    err: Exception, where: str, value: Any, names: Sequence[str] | None, hint: str | None = None
) -> ConfigError:
    """The ConfigError for an OmegaConf error about the key `where` of a typed node: `no such
    key` with the valid `names` when the node has no such key, else OmegaConf's own first line
    (`value 'x' of type 'str' could not be converted to Integer`)."""
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError

    if isinstance(err, (ConfigKeyError, ConfigAttributeError)):
        near = where.rsplit(".", 1)[-1]
        return ConfigError(where, value, "no such key", names, hint=hint, near=near)
    first = str(err).splitlines()[0].rstrip(".")
    if first.startswith("Value "):
        first = "v" + first[1:]
    return ConfigError(where, value, first)


def matches(value: Any, hint: Any) -> bool:
    """A lenient runtime type check for config values (ints pass as floats, lists as tuples)."""
    if hint is Any or hint is inspect.Parameter.empty:
        return True
    origin = typing.get_origin(hint)
    if origin is typing.Union or str(origin) == "<class 'types.UnionType'>":
        return any(matches(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if origin is typing.Literal:
        return value in typing.get_args(hint)
    if origin in (list, tuple, typing.Sequence, Sequence):
        return isinstance(value, (list, tuple))
    if origin is dict:
        return isinstance(value, dict)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint in (Path, os.PathLike):
        return isinstance(value, (str, Path))
    if isinstance(hint, type):
        return isinstance(value, hint)
    return True


def type_name(hint: Any) -> str:
    """`int`, `Optional[int]`, `list[str]` (a generic alias's __name__ drops its arguments)."""
    return hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")
