"""Helpers for schema fields that carry their own one-line description and valid choices."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any


def doc(default: Any, help: str, choices: Sequence[Any] | None = None) -> Any:
    """A dataclass field with a description (shown by `fw config`) and optional valid choices."""
    metadata = {"help": help}
    if choices is not None:
        metadata["choices"] = tuple(choices)
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
