"""A plain LightningModule and LightningDataModule, written the way Lightning's docs teach (its
own DataLoader(shuffle=True), its own configure_optimizers), get what framework tasks get: one
sample order for any process count, an exact resume after kill -9, and a real tensor-parallel
split of plain nn.Sequential layers."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import QUIET, fw, losses, metric_rows
from tests.distributed.test_resume import kill_then_restart

pytestmark = pytest.mark.slow
PLAIN = [
    "task._target_=tests.tasks.PlainDigits",
    "~task.model.dropout",
    "task.data._target_=tests.tasks.PlainDigitsData",
    "~task.data.val_fraction",
    "trainer.log_every_n_steps=1",
    "trainer.deterministic=true",
    "logger=[csv]",
    *QUIET,
]
STEPS = 20  # within the first epoch (1797 samples, 64 a step)


def train(*args: str, cwd) -> str:
    result = fw("train", *PLAIN, *args, cwd=cwd)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stderr


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    root = tmp_path_factory.mktemp("plain")
    train("task.data.batch_size=64", f"trainer.max_steps={STEPS}", "run.dir=run", cwd=root)
    return losses(root / "run")


def close(got: dict[int, float], want: dict[int, float]) -> bool:
    return sorted(got) == sorted(want) and all(abs(got[s] - want[s]) <= 1e-5 for s in want)


# 2 processes with half the batch, steps slowed (0.05 s) so that a test can kill a run mid-way
TWO = [
    "task._target_=tests.tasks.SlowPlainDigits",
    "trainer.devices=2",
    "task.data.batch_size=32",
    f"trainer.max_steps={STEPS}",
    "callbacks.checkpoint.every_n_steps=5",
]


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """TWO, uninterrupted: compared with one process, and the reference of the kill test."""
    root = tmp_path_factory.mktemp("plain_two")
    train(*TWO, "run.dir=run", cwd=root)
    return root / "run"


def test_two_processes_with_half_the_batch_reproduce_one_process(
    one_process, two_processes, workdir
):
    assert close(losses(two_processes), one_process)
    # the same loaders left to Lightning (task.data_order=keep) differ between 1 and 2
    # processes (a RandomSampler, then Lightning's DistributedSampler): the order is what differs
    keep = ["task.data_order=keep", f"trainer.max_steps={STEPS}"]
    train(*keep, "task.data.batch_size=64", "run.dir=keep1", cwd=workdir)
    train(*keep, "trainer.devices=2", "task.data.batch_size=32", "run.dir=keep2", cwd=workdir)
    assert not close(losses(workdir / "keep1"), losses(workdir / "keep2"))


def test_kill_9_then_restart_is_exact_for_a_plain_loader(two_processes, workdir):
    # 2 processes (one process: the same sampler, fewer ranks)
    err = kill_then_restart([*PLAIN, *TWO], workdir / "run", 12, workdir)
    assert "Resuming from" in err and "could not be restored" not in err
    got, want = metric_rows(workdir / "run"), metric_rows(two_processes)
    assert [s for s, _ in got] == list(range(STEPS)), "each step exactly once"
    assert got == want, "bitwise the uninterrupted run's losses"


def test_tensor_parallel_splits_a_plain_sequential_by_an_inferred_plan(one_process, workdir):
    shapes = [
        "+callbacks.shapes._target_=tests.tasks.LocalShapes",
        f"+callbacks.shapes.out={workdir}",
    ]
    err = train(
        "strategy=tensor",
        "trainer.devices=2",
        "task.data.batch_size=64",
        f"trainer.max_steps={STEPS}",
        *shapes,
        "run.dir=run",
        cwd=workdir,
    )
    assert "inferred from its structure" in err
    assert "strategy.tp_plan=[net.0:colwise,net.2:rowwise]" in err, "printed to copy"
    assert close(losses(workdir / "run"), one_process)
    for rank in (0, 1):
        local = json.loads((workdir / f"shapes-rank{rank}.json").read_text())
        # hidden 128 (the digits task's): each rank holds half of the hidden units
        assert local["net.0.weight"] == [64, 64] and local["net.0.bias"] == [64], "output split"
        assert local["net.2.weight"] == [10, 64] and local["net.2.bias"] == [10], "input split"


def test_a_custom_sampler_is_named_in_a_warning_at_start(workdir):
    err = train(
        "task.data._target_=tests.tasks.CustomSamplerDigits",
        "trainer.max_steps=3",
        "run.dir=run",
        cwd=workdir,
    )
    assert "A data loader with its sampler EvenFirstSampler: its position is not saved" in err
    assert torch.isfinite(torch.tensor(list(losses(workdir / "run").values()))).all()
