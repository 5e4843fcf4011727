"""No code outside a plugin's own package tests which plugin of its family a job uses (which
strategy, launcher, logger or callback): what `fw check`, `fw plan`, validation and the run's
messages need from a plugin they ask the plugin (its capabilities in framework.plugins), so a
plugin written from the docs is understood by all of them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from framework.config.compose import group_options
from framework.plugins import FAMILIES, builtin_kinds

ROOT = Path(__file__).resolve().parents[2] / "framework"
# what the other side of a comparison is called when it holds a plugin's name
WORDS = {
    "strategy": ("kind", "strategy"),
    "launcher": ("kind", "launcher"),
    "logger": ("kind", "logger"),
    "callbacks": ("kind", "callback"),
}


def kind_names(family: str) -> set[str]:
    """Every built-in kind of a family and every option of its config group (`strategy=zero3`,
    `launcher=slurm`)."""
    return set(builtin_kinds(family)) | set(group_options(family))


def strategy_names() -> set[str]:
    return kind_names("strategy")


def named(node: ast.AST, names: set[str]) -> bool:
    if isinstance(node, ast.Constant):
        return node.value in names
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(named(e, names) for e in node.elts)
    return False


def name_tests(
    source: str, names: set[str], words: tuple[str, ...] = WORDS["strategy"]
) -> list[tuple[int, str]]:
    """(line, text) of each comparison of something called by one of `words` with a plugin's
    name (`kind == "deepspeed"`, `cfg.strategy.kind != "parallel"`, `kind in ("zero1", ...)`)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        if not any(named(s, names) for s in sides):
            continue
        others = " ".join(ast.unparse(s) for s in sides if not named(s, names))
        if any(w in others for w in words):
            found.append((node.lineno, ast.unparse(node)))
    return found


def test_the_finder_sees_the_forms_that_ask_a_plugin_its_name():
    names = strategy_names()
    for text in (
        'if kind == "parallel":\n    pass',
        'x = cfg.strategy.kind != "deepspeed"',
        'ok = kind in ("zero1", "zero2")',
        'ok = "ddp" == strategy.get("kind")',
    ):
        assert name_tests(text, names), text
    assert not name_tests('ok = fmt == "deepspeed"\nfor s in ("ddp", "zero1"):\n    pass', names)
    launchers = kind_names("launcher")
    assert name_tests('ok = cfg.launcher.kind == "slurm"', launchers, WORDS["launcher"])
    assert name_tests(
        'if "wandb" in logger_kinds:\n    pass', kind_names("logger"), WORDS["logger"]
    )


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_no_plugin_name_is_tested_outside_its_plugin_package(family):
    names, plugins = kind_names(family), ROOT / FAMILIES[family].split(".")[1]
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        if path.is_relative_to(plugins) and path.parent != plugins:
            continue  # a plugin's own package may know its own name
        for line, text in name_tests(path.read_text(), names, WORDS[family]):
            found.append(f"{path.relative_to(ROOT.parent)}:{line}: {text}")
    assert not found, "ask the plugin (framework.plugins) instead:\n" + "\n".join(found)
