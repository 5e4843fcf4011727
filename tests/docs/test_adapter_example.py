"""The model-family adapter of docs/model_parallel.md, taken from the page's code block: once its
module is imported, a task holding its blocks is planned, checked and wrapped by it."""

from __future__ import annotations

import importlib
import re
import sys

import pytest
from torch import nn

from framework.errors import ConfigError
from framework.parallel import model as seam
from framework.parallel.infer import plan_for
from framework.parallel.tensor import collect_plan
from framework.parallel.transforms import layers
from tests.conftest import REPO

DOC = REPO / "docs" / "model_parallel.md"


def example() -> str:
    section = DOC.read_text().split("## 6. A model family of your own", 1)[1].split("\n## ")[0]
    (body,) = re.findall(r"```python\n(# my_models/blocks\.py\n.*?)```", section, flags=re.S)
    return body


def test_the_adapter_from_the_docs_plans_checks_and_wraps_its_blocks(tmp_path, monkeypatch):
    (tmp_path / "my_models").mkdir()
    (tmp_path / "my_models" / "blocks.py").write_text(example())
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(seam, "_registered", [])
    monkeypatch.delitem(sys.modules, "my_models.blocks", raising=False)
    blocks = importlib.import_module("my_models.blocks")  # registers the adapter
    task = nn.Sequential(blocks.Block(8, 16), blocks.Block(8, 16), nn.Linear(8, 32))
    assert [a.name for a in seam.adapter_for(task).adapters] == ["declared", "my_blocks"]
    plan = collect_plan(task)
    assert {k: type(v).__name__ for k, v in plan.items()} == {
        "0.up": "ColwiseParallel",
        "0.down": "RowwiseParallel",
        "1.up": "ColwiseParallel",
        "1.down": "RowwiseParallel",
    }
    assert layers(task) == [task[0], task[1]]  # FSDP units, checkpointing blocks
    assert plan_for(task, 2).plan == {}, "the family declares the plan: nothing else is inferred"
    with pytest.raises(ConfigError, match="strategy.tp=3: 0 has 16 hidden units"):
        seam.adapter_for(task).check_tensor(task, 3)
