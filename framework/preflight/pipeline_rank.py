"""A simulated pipeline rank's part of the step: its stages cut from the model, the input each
stage receives for one microbatch, their forward and backward, and how many microbatches'
activations the schedule keeps at once (framework/preflight/simulate.py runs them)."""

from __future__ import annotations

import contextlib

import torch


def pipeline_cut(task, cfg, dims, coords, batch):
    """This rank's stages (balanced by parameter count unless split points are given) and the
    input each of its stages receives for one microbatch (found by running the whole chain on
    fake tensors before the cut)."""
    from framework.parallel.pipeline import stages
    from framework.parallel.pipeline.schedule import inputs_and_targets

    owners = stages.stage_owners(cfg.schedule, dims.pp, cfg.virtual_stages)
    n_stages = sum(len(s) for s in owners)
    cut = stages.cut(task, list(cfg.split_points), n_stages, owners[coords["pp"]])
    x, y = inputs_and_targets(task, batch)
    rows = max(1, x.shape[0] // cfg.microbatches)
    x, y = x[:rows], y[:rows]
    inputs, h = {}, x
    with torch.no_grad(), experts_pass_through(task):
        for i, layer in enumerate(cut.chain):
            if i in cut.starts:
                s = cut.starts.index(i)
                inputs[s] = h if s == 0 else h.detach().requires_grad_(h.is_floating_point())
            h = layer.run(h)
    empty = [s for s in range(n_stages) if not cut.layers(s)]
    if empty:
        raise ValueError(f"pipeline stage {empty[0]} would hold no layer")
    inputs["target"] = y
    return cut, inputs


@contextlib.contextmanager
def experts_pass_through(task):
    """The task's MoE layers hand on their input while the stages' inputs are found: their
    output has their input's shape, and routing fake tokens has data-dependent shapes (the step
    itself then finds that, and the check reports model states only)."""
    from framework.parallel.experts import moe_layers

    layers = moe_layers(task)
    for layer in layers:
        layer.forward = _same
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward


def _same(x):
    return x


def stage_steps(task, modules, inputs, cut):
    """Forward and backward of one microbatch through each of this rank's stages."""
    from framework.parallel.pipeline.schedule import pipeline_objective

    last = len(cut.starts) - 1
    objective = pipeline_objective(task)  # the loss `fw train` computes on the last stage

    def run():
        for s in cut.mine:
            out = modules[s](inputs[s])
            if s == last:
                objective.begin(inputs["target"], 1)
                objective.loss(out, inputs["target"]).backward()
            else:
                out.backward(torch.ones_like(out))

    return run


def in_flight(cfg, dims, position: int) -> int:
    """Microbatches whose activations a pipeline rank holds at once: all of them for gpipe,
    at most the stages still ahead for the one-forward-one-backward schedules."""
    if cfg.schedule == "gpipe":
        return cfg.microbatches
    return max(1, min(cfg.microbatches, dims.pp - position) * cfg.virtual_stages)
