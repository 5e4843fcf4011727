"""Cutting models into pipeline stages: balanced cuts, split points, tied weights, dropped layers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from framework.parallel import pipeline
from recipes.gpt.task import GPTTask


def gpt(n_layer: int = 4) -> GPTTask:
    torch.manual_seed(0)
    return GPTTask(n_layer=n_layer, n_head=2, n_embd=32, block_size=16, sample_length=0)


def test_balance_minimises_the_heaviest_stage():
    assert pipeline.balance([1, 1, 1, 1], 2) == [0, 2]
    assert pipeline.balance([10, 1, 1, 1, 1, 10], 3) == [0, 1, 5]
    assert pipeline.balance([5, 5, 5], 3) == [0, 1, 2]
    with pytest.raises(ValueError, match="4 stages cannot be cut from 3 layers"):
        pipeline.balance([1, 1, 1], 4)


def test_gpt_chain_runs_like_the_model_and_counts_the_tied_weight_once():
    task = gpt()
    chain = pipeline.layers(task)
    assert [layer.name for layer in chain] == [
        "model.tok",
        *(f"model.blocks.{i}" for i in range(4)),
        "model.ln_f",
    ]
    pipeline.check_covered(task, chain)
    costs = pipeline.costs(task, chain)
    assert sum(costs) == sum(p.numel() for p in task.parameters())  # tied head counted once
    x = torch.randint(0, 256, (2, 16))
    staged = [pipeline.Stage(task, pipeline.stage_layers(chain, [0, 2, 4], s)) for s in range(3)]
    out = x
    for stage in staged:
        out = stage(out)
    assert torch.equal(out, task(x))


def test_measured_layer_times_cover_every_layer_and_leave_the_model_unchanged():
    task = gpt()
    chain = pipeline.layers(task)
    before = {n: p.detach().clone() for n, p in task.named_parameters()}
    x = torch.randint(0, 256, (2, 16))
    times = pipeline.time_layers(chain, x, lambda out: task.loss(out, x))
    assert len(times) == len(chain) and all(t > 0 for t in times)
    assert all(torch.equal(p, before[n]) for n, p in task.named_parameters())
    starts = pipeline.balance(times, 3)
    assert starts[0] == 0 and len(starts) == 3


def test_split_points_and_dropping_other_stages_keep_parameter_names():
    task = gpt()
    names = dict(task.named_parameters(remove_duplicate=False))
    chain = pipeline.layers(task)
    starts = pipeline.starts_at(chain, ["model.blocks.2"])
    assert starts == [0, 3]
    shared = pipeline.shared_parameters(task, chain, starts)
    assert [(n, s) for n, _, s in shared] == [("model.tok.weight", [0, 1])]
    pipeline.keep_only(task, chain, pipeline.stage_layers(chain, starts, 1))
    kept = dict(task.named_parameters(remove_duplicate=False))
    assert "model.tok.weight" not in kept and "model.blocks.0.ln1.weight" not in kept
    assert kept["model.head.weight"] is names["model.head.weight"]  # the tie's other end stays
    assert set(kept) == {n for n in names if n.startswith(("model.blocks.2", "model.blocks.3"))} | {
        "model.ln_f.weight",
        "model.ln_f.bias",
        "model.head.weight",
    }


def test_sequential_models_split_at_their_children():
    class Task(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))

    chain = pipeline.layers(Task())
    assert [layer.name for layer in chain] == ["net.0", "net.1", "net.2"]
    with pytest.raises(KeyError):
        pipeline.starts_at(chain, ["net.7"])
    with pytest.raises(ValueError, match="not in layer order"):
        pipeline.starts_at(chain, ["net.2", "net.1"])


def test_a_model_without_layers_is_refused_with_the_remedy():
    class Task(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = nn.Linear(4, 2)

    with pytest.raises(ValueError, match="pipeline_layers"):
        pipeline.layers(Task())
