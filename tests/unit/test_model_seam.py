"""One seam for model families, one list of kinds per plugin family.

Generic code asks `framework.parallel.model.adapter_for(task)` what a model is made of and never
imports a family's integration; a family a user registers is split like a built-in one; every
plugin family names its kinds, and helpers beside them are not kinds."""

from __future__ import annotations

import ast
import re

import pytest
import torch
from torch import nn

from framework.errors import ConfigError
from framework.parallel import model as seam
from framework.parallel.tensor import collect_plan
from framework.parallel.transforms import layers
from framework.plugins import FAMILIES, builtin_kinds, load_plugin
from tests.conftest import REPO
from tests.unit.test_imports import PACKAGE, import_graph

INTEGRATIONS = "framework.integrations"


def test_no_module_outside_an_integration_imports_it():
    graph = import_graph()
    found = [
        f"{importer} -> {target}"
        for importer, targets in sorted(graph.items())
        if not importer.startswith(INTEGRATIONS)
        for target in sorted(targets)
        if target.startswith(f"{INTEGRATIONS}.")
    ]
    assert found == [], "ask framework.parallel.model.adapter_for(task) instead"


def family_names(source: str) -> list[int]:
    """Lines of code (not docstrings) that import transformers or name it as a string."""
    tree = ast.parse(source)
    docs = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            named = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            named = [node.module or ""]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            named = [] if id(node) in docs else [node.value]
        else:
            continue
        if any(re.fullmatch(r"transformers(\..*)?", n) for n in named):
            lines.append(node.lineno)
    return lines


def test_no_generic_module_branches_on_transformers():
    assert family_names('import sys\nx = sys.modules.get("transformers")\n') == [2]
    assert family_names('"""transformers, in a docstring."""\n') == []
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.is_relative_to(PACKAGE / "integrations"):
            continue
        found += [f"{path.relative_to(REPO)}:{n}" for n in family_names(path.read_text())]
    assert found == []


class Packed(nn.Module):
    """A module of a family nobody here wrote: no tp_plan(), no ModuleList."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class PackedAdapter(seam.FamilyAdapter):
    name = "packed"

    def claims(self, task):
        return any(isinstance(m, Packed) for m in task.modules())

    def tensor_plan(self, task, **_):
        found = {}
        for name, module in task.named_modules():
            if isinstance(module, Packed):
                found |= {f"{name}.up": "colwise", f"{name}.down": "rowwise"}
        return found

    def blocks(self, task):
        return [m for m in task.modules() if isinstance(m, Packed)]


class Task(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = Packed(), Packed()
        self.head = nn.Linear(8, 2)


def test_a_family_a_user_registers_is_split_and_shards_by_its_own_layers(monkeypatch):
    task = Task()
    assert collect_plan(task) == {}  # nothing declared, no family claims it
    assert layers(task) == []
    monkeypatch.setattr(seam, "_registered", [])
    seam.register(PackedAdapter())
    plan = collect_plan(task)
    assert sorted(plan) == ["first.down", "first.up", "second.down", "second.up"]
    assert type(plan["first.up"]).__name__ == "ColwiseParallel"
    assert layers(task) == [task.first, task.second]
    assert [a.name for a in seam.adapter_for(task).adapters] == ["declared", "packed"]
    assert [a.name for a in seam.adapter_for(nn.Linear(2, 2)).adapters] == ["declared"]


def test_every_family_lists_its_kinds_and_each_loads():
    for family in FAMILIES:
        kinds = builtin_kinds(family)
        assert kinds, family
        for kind in kinds:
            load_plugin(family, kind, f"{family}.kind")  # a plugin of its family's protocol


def test_every_config_option_names_a_listed_kind():
    groups = {"strategy": "strategy", "logger": "logger", "callbacks": "callbacks"}
    groups["launcher"] = "launcher"
    found = []
    for path in sorted((REPO / "conf").rglob("*.yaml")):
        for group, kind in re.findall(r"/schema/(\w+)/(\w+)", path.read_text()):
            if group in groups and kind not in builtin_kinds(groups[group]):
                found.append(f"{path.relative_to(REPO)}: {group}/{kind}")
    assert found == []


@pytest.mark.parametrize(
    ("family", "kind", "valid"),
    [
        ("launcher", "locl", ["local", "ray", "slurm"]),
        ("launcher", "rendezvous", ["local", "ray", "slurm"]),  # a helper of the launchers
        ("strategy", "settings", ["ddp", "deepspeed", "diloco", "hogwild", "parallel"]),
    ],
)
def test_a_helper_or_a_typo_is_no_kind_and_the_valid_ones_are_listed(family, kind, valid):
    with pytest.raises(ConfigError) as err:
        load_plugin(family, kind, f"{family}.kind")
    assert f"Valid choices: {', '.join(valid)}." in str(err.value)
