"""Resuming under another strategy or process count: ddp <-> zero1/2/3 <-> fsdp, 2 <-> 4 processes.

Every source run trains digits for 5 steps with a global batch of 64 (batch 64/N per process) and
saves; the move resumes it to step 10 under another layout. The result must be the run that never
moved: the per-step losses and the final weights of a 10-step ddp run.
"""

from __future__ import annotations

import functools
import json
import shutil

import pytest
import torch

from framework import portable, resume
from framework.errors import ConfigError
from framework.export import consolidated_state
from framework.strategies import deepspeed
from tests.conftest import QUIET, assert_resumed, fw, losses

pytestmark = pytest.mark.slow
COMMON = [
    *QUIET,
    "task=digits",
    "trainer.deterministic=true",
    "trainer.log_every_n_steps=1",
    "logger=[csv]",
    "callbacks.checkpoint.every_n_steps=5",
]
# one source per kind of partition: whole (ddp), ZeRO stage 1/2 flat groups, stage 3
# per-parameter partitions over 4 processes, DTensor shards (fsdp)
SOURCES = [("ddp", 2), ("zero2", 2), ("zero3", 4), ("fsdp", 2)]


def train(strategy: str, n: int, steps: int, run, cwd) -> str:
    args = [f"strategy={strategy}", f"trainer.devices={n}", f"task.data.batch_size={64 // n}"]
    result = fw("train", *args, *COMMON, f"trainer.max_steps={steps}", f"run.dir={run}", cwd=cwd)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stderr


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The 10-step ddp reference and a 5-step checkpointed run of every source layout."""
    root = tmp_path_factory.mktemp("moves")
    train("ddp", 2, 10, root / "reference", root)
    for strategy, n in SOURCES:
        train(strategy, n, 5, root / f"{strategy}-{n}", root)
    return root


def test_every_layout_reads_back_as_the_same_full_state(runs):
    """Model and optimizer state merged from any sharding equal ddp's, shapes without padding."""
    want = portable.read(runs / "ddp-2" / "checkpoints" / "step00000005")
    for strategy, n in SOURCES[1:]:
        got = portable.read(runs / f"{strategy}-{n}" / "checkpoints" / "step00000005")
        assert got.model.keys() == want.model.keys()
        for name, tensor in want.model.items():
            assert got.model[name].shape == tensor.shape, (strategy, n, name)
            assert torch.allclose(got.model[name], tensor, atol=1e-6), (strategy, n, name)
        (g,), (w,) = got.optimizers, want.optimizers
        assert g["state"].keys() == w["state"].keys()
        for name, slots in w["state"].items():
            assert g["state"][name].keys() == slots.keys()
            for key, value in slots.items():
                assert g["state"][name][key].shape == value.shape, (strategy, n, name, key)
                assert torch.allclose(g["state"][name][key], value, atol=1e-6), (strategy, name)
        assert [x["lr"] for x in g["groups"]] == [x["lr"] for x in w["groups"]]
        assert got.rest["global_step"] == 5


MOVES = [
    (("ddp", 2), ("zero2", 2)),
    (("zero2", 2), ("zero3", 4)),
    (("zero3", 4), ("fsdp", 2)),
    (("fsdp", 2), ("ddp", 1)),
    (("fsdp", 2), ("zero2", 4)),
]


@pytest.mark.parametrize(("source", "target"), MOVES, ids=lambda x: f"{x[0]}x{x[1]}")
def test_resume_moves_to_another_strategy_and_process_count(source, target, runs, workdir):
    run = workdir / "run"
    shutil.copytree(runs / f"{source[0]}-{source[1]}", run, symlinks=True)
    err = train(target[0], target[1], 10, run, workdir)
    assert "Moving checkpoint step00000005" in err
    assert_resumed(err, run, 10, moved=True)
    got, want = losses(run), losses(runs / "reference")
    assert sorted(got) == sorted(want) == list(range(10))
    assert all(abs(got[s] - want[s]) <= 1e-5 for s in want), (got, want)
    moved = consolidated_state(run / "checkpoints" / "step00000010")
    reference = consolidated_state(runs / "reference" / "checkpoints" / "step00000010")
    assert moved.keys() == reference.keys()
    assert all(torch.allclose(moved[k], reference[k], atol=1e-5) for k in reference)


def test_gpt_moves_through_three_layouts_and_stays_on_the_ddp_trajectory(workdir):
    """Two param groups, tied embedding/head and a warm-up schedule survive ddp -> zero3 -> fsdp."""
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
    ref = fw("train", "strategy=ddp", "trainer.devices=2", *gpt, "run.dir=ref", cwd=workdir)
    assert ref.returncode == 0, ref.stderr[-3000:]
    for strategy, n, steps in (("ddp", 2, 7), ("zero3", 4, 14), ("fsdp", 2, 20)):
        args = [f"strategy={strategy}", f"trainer.devices={n}", f"task.data.batch_size={16 // n}"]
        moved = fw("train", *args, *gpt, f"trainer.max_steps={steps}", "run.dir=run", cwd=workdir)
        assert moved.returncode == 0, moved.stderr[-3000:]
        if steps > 7:
            assert_resumed(moved.stderr, workdir / "run", steps, moved=True)
    got, want = losses(workdir / "run"), losses(workdir / "ref")
    assert sorted(got) == sorted(want) and len(got) == 20
    assert all(abs(got[s] - want[s]) <= 1e-5 for s in want), (got, want)


def test_impossible_moves_are_refused_before_launch(runs, workdir):
    # into NVMe offload: checked before launch (here in-process: on machines without libaio
    # `fw train` refuses NVMe offload itself, earlier, with another message)
    ckpt = runs / "zero2-2" / "checkpoints" / "step00000005"
    nvme = functools.partial(deepspeed.check_move, deepspeed.Config(offload_optimizer="nvme"))
    with pytest.raises(ConfigError, match="cannot be filled from another layout"):
        resume.check_layout(ckpt, "deepspeed", 4, nvme)
    resume.check_layout(ckpt, "deepspeed", 2, nvme)  # same layout: loads as it is
    # a ddp checkpoint from before parameter names were recorded
    old = workdir / "old"
    shutil.copytree(runs / "ddp-2", old, symlinks=True)
    config = (old / "config.yaml").read_text()
    meta_path = old / "checkpoints" / "step00000005" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta.pop("parameter_names")
    meta_path.write_text(json.dumps(meta))
    legacy = fw(
        "train", "strategy=fsdp", "trainer.devices=2", *COMMON, f"run.dir={old}", cwd=workdir
    )
    assert legacy.returncode == 2 and "Resume it with strategy=ddp" in legacy.stderr
    assert "Traceback" not in legacy.stderr
    assert (old / "config.yaml").read_text() == config, "nothing rewritten"
