"""What a worker knows about its run besides the config: where, which run, resuming from what."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from framework import secrets
from framework.world import World

# Config keys whose change makes a checkpoint unusable (the model or optimizer would not match).
BREAKING = ("task._target_", "task.model.", "task.optimizer._target_", "task.data._target_", "seed")


@dataclass(frozen=True)
class RunContext:
    """Run directory, identity and resume point handed to plugins that need them."""

    run_dir: Path
    run_name: str
    run_id: str
    group: str | None
    config: dict[str, Any]  # resolved, secrets redacted
    world: World
    resume_from: Path | None = None
    resume_step: int = 0
    data_parallel: tuple[int, int] = (0, 1)  # (rank, size) among ranks reading different data
    checkpoint_format: str = "lightning"  # the layout the strategy's checkpoints are written in
    secret_keys: tuple[str, ...] = ()  # extra key names whose values are secret (run.secret_keys)
    secret_values: frozenset[str] = frozenset()  # values never to write (framework.secrets)
    command: str = "fit"  # what the job does: fit, or validate, test, predict (an evaluation)

    def clean(self, params: Any) -> Any:
        """Hyperparameters as they may be written to disk or a logger: secrets replaced."""
        return secrets.clean(params, self.secret_values, secrets.key_pattern(self.secret_keys))

    @property
    def config_hash(self) -> str:
        return config_hash(self.config)


def config_hash(config: dict[str, Any]) -> str:
    """Hash of the parts of a config a checkpoint depends on (see BREAKING)."""
    relevant = {k: v for k, v in flatten(config).items() if k.startswith(BREAKING) or k in BREAKING}
    return hashlib.sha256(json.dumps(relevant, sort_keys=True, default=str).encode()).hexdigest()[
        :16
    ]


def flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict) and node:
        out: dict[str, Any] = {}
        for k, v in node.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    return {prefix.rstrip("."): node}


def config_changes(
    old: dict[str, Any], new: dict[str, Any], describe: Callable[[dict], str] | None = None
) -> tuple[list[str], list[str]]:
    """(breaking, harmless) differences between a checkpoint's config and the current one.
    `describe` names a config's strategy (framework.plugins.describe_strategy; default: its
    kind) in the one line that says the strategy changed."""
    a, b = flatten(old), flatten(new)
    breaking, harmless = [], []
    if a.get("strategy.kind") != b.get("strategy.kind"):
        # Another strategy plugin: its settings differ wholesale; name the move once.
        name = describe or (lambda c: str((c.get("strategy") or {}).get("kind", "<absent>")))
        harmless.append(f"strategy: {name(old)} -> {name(new)}")
        a = {k: v for k, v in a.items() if not k.startswith("strategy.")}
        b = {k: v for k, v in b.items() if not k.startswith("strategy.")}
    for key in sorted(set(a) | set(b)):
        if key.startswith("run.") or a.get(key, "<absent>") == b.get(key, "<absent>"):
            continue
        line = f"{key}: {a.get(key, '<absent>')} -> {b.get(key, '<absent>')}"
        (breaking if key.startswith(BREAKING) or key in BREAKING else harmless).append(line)
    return breaking, harmless


def load_run_state(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "run.json"
    return json.loads(path.read_text()) if path.is_file() else {}
