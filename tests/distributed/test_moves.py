"""Resuming under another strategy or process count: ddp <-> zero1/2/3 <-> fsdp, 1 <-> 2 <-> 4
processes.

One digits run moves through every kind of partition: each layout of CHAIN trains 4 steps on
from the checkpoint the layout before it wrote (a global batch of 64: batch 64/N per process),
and fsdp's checkpoint moves into zero2 on 4 processes as well. The result must be the run that
never moved: the per-step losses and the weights of a 20-step ddp run at the same step.
"""

from __future__ import annotations

import functools
import itertools
import json
import shutil
from types import SimpleNamespace

import pytest
import torch

from framework.checkpoint import resume
from framework.checkpoint.export import consolidated_state
from framework.checkpoint.load import read_whole
from framework.errors import ConfigError
from framework.strategies import deepspeed
from tests.conftest import QUIET, assert_resumed, fw, losses

pytestmark = pytest.mark.slow
LEG = 4  # steps each layout trains, and the checkpoint interval
COMMON = [
    *QUIET,
    "task=digits",
    "trainer.deterministic=true",
    "trainer.log_every_n_steps=1",
    "logger=[csv]",
    f"callbacks.checkpoint.every_n_steps={LEG}",
]
# one layout per kind of partition: whole (ddp), ZeRO stage 1/2 flat groups, stage 3
# per-parameter partitions over 4 processes, DTensor shards (fsdp); then whole on 1 process
CHAIN = [("ddp", 2), ("zero2", 2), ("zero3", 4), ("fsdp", 2), ("ddp", 1)]
BRANCH = (("fsdp", 2), ("zero2", 4))  # a second move out of fsdp's checkpoint
MOVES = [*itertools.pairwise(CHAIN), BRANCH]
STEPS = LEG * len(CHAIN)
END = {**{layout: LEG * (i + 1) for i, layout in enumerate(CHAIN)}, BRANCH[1]: STEPS}


def name(layout: tuple[str, int]) -> str:
    return f"{layout[0]}-{layout[1]}"


def step_dir(run, step: int):
    return run / "checkpoints" / f"step{step:08d}"


def train(layout: tuple[str, int], steps: int, run, cwd, *extra: str) -> str:
    strategy, n = layout
    args = [f"strategy={strategy}", f"trainer.devices={n}", f"task.data.batch_size={64 // n}"]
    args += [*COMMON, *extra, f"trainer.max_steps={steps}", f"run.dir={run}"]
    result = fw("train", *args, cwd=cwd)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stderr


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The 20-step ddp reference (every checkpoint kept) and the moved run: `root / name(layout)`
    is the run directory as `layout` left it, `errs[layout]` what its leg printed."""
    root = tmp_path_factory.mktemp("moves")
    train(("ddp", 2), STEPS, root / "reference", root, f"callbacks.checkpoint.keep_last={STEPS}")
    errs, run = {}, root / "run"
    for layout in CHAIN:
        errs[layout] = train(layout, END[layout], run, root)
        shutil.copytree(run, root / name(layout), symlinks=True)
    source, target = BRANCH
    shutil.copytree(root / name(source), root / name(target), symlinks=True)
    errs[target] = train(target, END[target], root / name(target), root)
    return SimpleNamespace(root=root, errs=errs)


def test_every_layout_reads_back_as_the_same_full_state(runs):
    """Model and optimizer state merged from any sharding equal ddp's, shapes without padding."""
    for layout in (layout for layout in CHAIN if layout[0] != "ddp"):
        step = END[layout]
        want = read_whole(step_dir(runs.root / "reference", step))
        got = read_whole(step_dir(runs.root / name(layout), step))
        assert got.model.keys() == want.model.keys()
        for key, tensor in want.model.items():
            assert got.model[key].shape == tensor.shape, (layout, key)
            assert torch.allclose(got.model[key], tensor, atol=1e-6), (layout, key)
        (g,), (w,) = got.optimizers, want.optimizers
        assert g["state"].keys() == w["state"].keys()
        for key, slots in w["state"].items():
            assert g["state"][key].keys() == slots.keys()
            for slot, value in slots.items():
                assert g["state"][key][slot].shape == value.shape, (layout, key, slot)
                assert torch.allclose(g["state"][key][slot], value, atol=1e-6), (layout, key)
        assert [x["lr"] for x in g["groups"]] == [x["lr"] for x in w["groups"]]
        assert got.rest["global_step"] == step


@pytest.mark.parametrize(("source", "target"), MOVES, ids=lambda x: f"{x[0]}x{x[1]}")
def test_resume_moves_to_another_strategy_and_process_count(source, target, runs):
    run, err, end = runs.root / name(target), runs.errs[target], END[target]
    assert f"Moving checkpoint step{END[source]:08d}" in err
    assert_resumed(err, run, end, moved=True)
    got, want = losses(run), losses(runs.root / "reference")
    assert sorted(got) == list(range(end)) and sorted(want) == list(range(STEPS))
    assert all(abs(got[s] - want[s]) <= 1e-5 for s in got), (got, want)
    moved = consolidated_state(step_dir(run, end))
    reference = consolidated_state(step_dir(runs.root / "reference", end))
    assert moved.keys() == reference.keys()
    assert all(torch.allclose(moved[k], reference[k], atol=1e-5) for k in reference)


def test_gpt_moves_through_three_layouts_and_stays_on_the_ddp_trajectory(one_process, workdir):
    """Two param groups, tied embedding/head and a warm-up schedule survive ddp -> zero3 -> fsdp:
    the losses stay those of the one-process ddp run gpt16 (tests/distributed/conftest.py)."""
    gpt = [
        *QUIET,
        "experiment=gpt_tiny",
        "task.scheduler.name=constant",  # warm-up only: the schedule does not depend on max_steps
        "trainer.val_check_interval=20",
        "trainer.deterministic=true",
        "trainer.log_every_n_steps=1",
        "logger=[csv]",
        "callbacks.checkpoint.every_n_steps=7",
    ]
    for strategy, n, steps in (("ddp", 2, 7), ("zero3", 4, 14), ("fsdp", 2, 20)):
        args = [f"strategy={strategy}", f"trainer.devices={n}", f"task.data.batch_size={16 // n}"]
        moved = fw("train", *args, *gpt, f"trainer.max_steps={steps}", "run.dir=run", cwd=workdir)
        assert moved.returncode == 0, moved.stderr[-3000:]
        if steps > 7:
            assert_resumed(moved.stderr, workdir / "run", steps, moved=True)
    got, want = losses(workdir / "run"), one_process["gpt16"]
    assert sorted(got) == sorted(want) and len(got) == 20
    assert all(abs(got[s] - want[s]) <= 1e-5 for s in want), (got, want)


def test_impossible_moves_are_refused_before_launch(runs, workdir):
    # into NVMe offload: checked before launch (here in-process: on machines without libaio
    # `fw train` refuses NVMe offload itself, earlier, with another message)
    ckpt = step_dir(runs.root / "zero2-2", END[("zero2", 2)])
    nvme = functools.partial(deepspeed.check_move, deepspeed.Config(offload_optimizer="nvme"))
    with pytest.raises(ConfigError, match="cannot be filled from another layout"):
        resume.check_layout(ckpt, "deepspeed", 4, nvme)
    resume.check_layout(ckpt, "deepspeed", 2, nvme)  # same layout: loads as it is
    # a ddp checkpoint from before parameter names were recorded
    old = workdir / "old"
    shutil.copytree(runs.root / "ddp-2", old, symlinks=True)
    config = (old / "config.yaml").read_text()
    meta_path = step_dir(old, END[("ddp", 2)]) / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta.pop("parameter_names")
    meta_path.write_text(json.dumps(meta))
    # through the fw command: in this process, a logging handler another in-process test left on
    # a closed stream would print a "--- Logging error ---" traceback into what is checked here
    legacy = fw(
        "train", "strategy=fsdp", "trainer.devices=2", *COMMON, f"run.dir={old}", cwd=workdir
    )
    assert legacy.returncode == 2 and "Resume it with strategy=ddp" in legacy.stderr
    assert "Traceback" not in legacy.stderr
    assert (old / "config.yaml").read_text() == config, "nothing rewritten"
