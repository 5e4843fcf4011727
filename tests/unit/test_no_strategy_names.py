"""No code outside a strategy plugin's own package tests which strategy a job uses: what `fw
check`, `fw plan`, validation and the run's messages need from a strategy they ask its plugin
(framework.plugins.StrategyCapabilities), so a strategy written from docs/strategies.md is
understood by all of them."""

from __future__ import annotations

import ast
from pathlib import Path

from framework.config.compose import group_options
from framework.plugins import builtin_kinds

ROOT = Path(__file__).resolve().parents[2] / "framework"
PLUGINS = ROOT / "strategies"


def strategy_names() -> set[str]:
    """Every built-in strategy kind and every strategy option (`strategy=zero3`)."""
    return set(builtin_kinds("strategy")) | set(group_options("strategy"))


def named(node: ast.AST, names: set[str]) -> bool:
    if isinstance(node, ast.Constant):
        return node.value in names
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(named(e, names) for e in node.elts)
    return False


def name_tests(source: str, names: set[str]) -> list[tuple[int, str]]:
    """(line, text) of each comparison of something called kind or strategy with a strategy's
    name (`kind == "deepspeed"`, `cfg.strategy.kind != "parallel"`, `kind in ("zero1", ...)`)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        text = ast.get_source_segment(source, node) or ""
        others = " ".join(
            ast.get_source_segment(source, s) or "" for s in sides if not named(s, names)
        )
        if any(named(s, names) for s in sides) and ("kind" in others or "strategy" in others):
            found.append((node.lineno, text))
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


def test_no_strategy_name_is_tested_outside_its_plugin_package():
    names = strategy_names()
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        if path.is_relative_to(PLUGINS) and path.parent != PLUGINS:
            continue  # a plugin's own package may know its own name
        for line, text in name_tests(path.read_text(), names):
            found.append(f"{path.relative_to(ROOT.parent)}:{line}: {text}")
    assert not found, "ask the plugin (framework.plugins.capability) instead:\n" + "\n".join(found)
