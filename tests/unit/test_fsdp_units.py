"""How FSDP (framework.parallel.fsdp) picks its sharding units (every parameter in one, innermost first)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from framework.parallel.fsdp import check_direct_parameters, units
from recipes.gpt.task import GPTTask


def names(mods):
    return [type(m).__name__ for m in mods]


def test_blocks_then_top_level_children():
    task = GPTTask(n_layer=2, n_head=2, n_embd=32, block_size=16)
    assert names(units(task, [])) == ["TransformerBlock", "TransformerBlock", "GPT"]
    nested = units(task, ["TransformerBlock", "Attention"])
    assert names(nested) == ["Attention"] * 2 + ["TransformerBlock"] * 2 + ["GPT"]
    covered = {id(p) for m in nested for p in m.parameters()}
    assert covered == {id(p) for p in task.parameters()}


def test_parameters_held_by_the_task_itself_are_refused():
    class Bare(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(1))
            self.net = nn.Linear(2, 2)

    with pytest.raises(ValueError, match="holds parameters directly: scale"):
        check_direct_parameters(Bare())
