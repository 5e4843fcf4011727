"""`fw train --help` and `fw config`: every group, option and field with its description."""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf

from framework import secrets
from framework.config.compose import GROUPS, compose_config, group_options
from framework.config.fields import field_help


def train_help(extra_dirs: list[Path] | None = None) -> str:
    lines = [
        "usage: fw train [-m] [--config-dir DIR] [--trust] [KEY=VALUE ...]",
        "",
        "  -m, --multirun    one job per value of each swept key (KEY=a,b)",
        "  --config-dir DIR  another directory of config groups, searched before the built-in",
        "                    ones: an option of the same name replaces the built-in option",
        "  --cfg job|all     print the composed config (what fw config prints) and stop",
        "  --trust           resume from a checkpoint whose pickles name more than data (refused",
        "                    otherwise: loading it could run code; see docs/security.md)",
        "",
        "Config groups (choose one option with GROUP=OPTION; logger takes a list: logger=[csv]):",
    ]
    for group in GROUPS:
        lines.append(f"  {group:<11} {', '.join(group_options(group, extra_dirs)) or '(none yet)'}")
    lines += [
        "",
        "Any field can be overridden with KEY=VALUE (e.g. trainer.max_steps=100), a key added with",
        "+KEY=VALUE or removed with ~KEY. See every field and its description with:",
        "  fw config [GROUP=OPTION ...]",
        "",
    ]
    return "\n".join(lines)


def show_config(overrides: list[str], extra_dirs: list[Path] | None = None) -> str:
    """The composed config as YAML, each field followed by its description."""
    return render_config(compose_config(overrides, extra_dirs))


def render_config(cfg: DictConfig) -> str:
    """A config as YAML, each field followed by its description, secrets redacted."""
    pattern = secrets.key_pattern(cfg.run.secret_keys)
    return secrets.redact_text("\n".join(render(cfg, 0, None, pattern)) + "\n")


def render(node: Any, indent: int, owner: Any, pattern: re.Pattern[str]) -> list[str]:
    schema = OmegaConf.get_type(node) if isinstance(node, DictConfig) else None
    described = dataclasses.is_dataclass(schema)
    signature = _signature(node) if isinstance(node, DictConfig) else {}
    lines = []
    pad = "  " * indent
    for key in node:
        child = node._get_node(key)
        help_text = field_help(schema, str(key)) if described else signature.get(str(key), "")
        comment = f"  # {help_text}" if help_text else ""
        if isinstance(child, DictConfig) and len(child):
            lines.append(f"{pad}{key}:{comment}")
            lines += render(child, indent + 1, node, pattern)
        else:
            value = (
                child._value()
                if not isinstance(child, (DictConfig, ListConfig))
                else OmegaConf.to_container(child)
            )
            if secrets.is_secret_key(key, pattern) and value not in (None, ""):
                # printed: a credential never is; `${oc.env:NAME}` says where it comes from
                value = value if OmegaConf.is_interpolation(node, key) else secrets.REDACTED
            text = yaml.safe_dump(value, default_flow_style=True, width=1000).strip()
            text = text.removesuffix("\n...").removesuffix("...").strip()
            lines.append(f"{pad}{key}: {text}{comment}")
    return lines


def _signature(node: DictConfig) -> dict[str, str]:
    """Annotations of the class a node's `_target_` names (for task.model, task.data, ...)."""
    target = node.get("_target_") if "_target_" in node else None
    if target is None and node._key() == "model" and node._get_parent() is not None:
        target = node._get_parent().get("_target_")
    if not isinstance(target, str):
        return {}
    try:
        from hydra.utils import get_class

        params = inspect.signature(get_class(target)).parameters
    except Exception:
        return {}
    return {
        name: f"{getattr(p.annotation, '__name__', p.annotation)}".replace("<class '", "").replace(
            "'>", ""
        )
        for name, p in params.items()
        if p.annotation is not p.empty
    }
