"""Context parallel (`strategy.cp`): gpt_tiny with each sequence split over 2 processes
reproduces one process (ring, ulysses, and allgather under cp=2 x fsdp=2 on 4); a cp=2
checkpoint resumes on one process; bad settings are refused before launch."""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest

from tests.conftest import QUIET, assert_resumed, fw, losses, read_metrics, refused
from tests.distributed.conftest import GPT

pytestmark = pytest.mark.slow
COMMON = [*QUIET, "trainer.deterministic=true", "trainer.log_every_n_steps=1", "logger=[csv]"]
CP2 = ["strategy=fsdp", "strategy.cp=2"]


def train(run, *args: str, cwd) -> str:
    result = fw("train", *GPT, *COMMON, *args, f"run.dir={run}", cwd=cwd)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stderr


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """ring: cp=2 for 10 steps (checkpoint at 10), moved: its run continued on one process to
    20; ulysses: cp=2 for 20 steps (validation at 20); allgather: cp=2 x fsdp=2 for 10 steps."""
    root = tmp_path_factory.mktemp("context")
    batch8 = ["task.data.batch_size=8", "trainer.devices=2"]
    train(root / "ring", *CP2, *batch8, "trainer.max_steps=10", cwd=root)
    shutil.copytree(root / "ring", root / "moved", symlinks=True)
    moved = train(
        root / "moved", "strategy=ddp", "trainer.devices=1", "task.data.batch_size=8", cwd=root
    )
    train(root / "ulysses", *CP2, "strategy.cp_mode=ulysses", *batch8, cwd=root)
    four = ["strategy.cp_mode=allgather", "trainer.devices=4", "task.data.batch_size=8"]
    train(root / "allgather", *CP2, *four, "trainer.max_steps=10", cwd=root)
    return SimpleNamespace(root=root, moved=moved)


def assert_same(run, want, steps: int) -> None:
    got = losses(run)
    assert sorted(got) == list(range(steps)), sorted(got)
    assert all(abs(got[s] - want[s]) <= 1e-5 for s in got), (got, want)


def val_loss(run) -> float:
    return float(next(r["val/loss"] for r in read_metrics(run) if r.get("val/loss")))


@pytest.mark.parametrize(
    ("name", "reference", "steps"),
    [("ring", "gpt8", 10), ("ulysses", "gpt8", 20), ("allgather", "gpt16", 10)],
)
def test_split_sequences_train_as_one_process(runs, one_process, name, reference, steps):
    """Same global batch, per-step losses within 1e-5 of the one-process run (cp=2 x fsdp=2
    reads 2 batches of 8 per step: gpt16)."""
    assert_same(runs.root / name, one_process[reference], steps)


def test_validation_loss_counts_every_token_once(runs, one_process):
    assert abs(val_loss(runs.root / "ulysses") - val_loss(one_process["root"] / "gpt8")) <= 1e-5


def test_cp_checkpoint_resumes_on_one_process(runs, one_process):
    assert_resumed(runs.moved, runs.root / "moved", 20, moved=True)
    assert_same(runs.root / "moved", one_process["gpt8"], 20)


BASE = ["experiment=gpt_tiny", *CP2, "trainer.devices=2"]


@pytest.mark.parametrize(
    ("args", "says"),
    [
        ([*BASE, "task.model.block_size=66"], "task.model.block_size"),
        ([*BASE, "strategy.cp_mode=ulysses", "task.model.n_head=1"], "cp_mode=ulysses"),
        (
            ["experiment=gpt_tiny", "strategy=fsdp", "strategy.cp=3", "trainer.devices=2"],
            "borrows its ranks from the fsdp degree",
        ),
        ([*BASE, "strategy.cp_mode=spiral"], "ring"),
        (["task=digits", *CP2, "trainer.devices=2"], "has no attention"),
    ],
    ids=["length", "ulysses-heads", "cp-does-not-divide", "mode", "no-attention"],
)
def test_bad_settings_are_refused_before_launch(args, says, workdir, monkeypatch, capsys):
    line = refused(args, workdir, monkeypatch, capsys)
    assert says in line, line


def test_fw_check_divides_activations_by_cp():
    """fw check simulates a cp rank on its chunks: at cp=2 its activations are at most 0.55x
    those of cp=1 (the same batch per rank; measured 0.52x)."""
    from framework.preflight.check import check

    gpt = ["task=gpt", "task.model.n_layer=2", "task.model.n_embd=64", "task.model.n_head=2"]
    base = [*gpt, "task.model.block_size=1024", "task.data.batch_size=4", "strategy=fsdp"]
    per_rank = {
        cp: max(
            r.activations for r in check([*base, "trainer.devices=2", f"strategy.cp={cp}"]).ranks
        )
        for cp in (1, 2)
    }
    assert per_rank[2] <= 0.55 * per_rank[1], per_rank
