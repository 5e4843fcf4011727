"""Helpers for schema fields that carry their own one-line description, valid choices and bounds.

Bounds are declared next to the field (`doc(1, "...", min=1)`) and checked for every group at
compose time (framework.config.validate), before anything starts; `None` always passes a bound
(an optional field that is unset).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any


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
