"""Each recipe trains end to end through `fw train` under 1 and 2 processes (digits under 2:
tests/distributed/test_ddp.py, the same losses as 1 and the run directory it leaves)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import QUIET, fw, losses, read_metrics

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("devices", [1])
def test_digits_trains(devices, workdir):
    result = fw(
        "train",
        "task=digits",
        f"trainer.devices={devices}",
        "trainer.max_steps=15",
        "trainer.log_every_n_steps=1",
        *QUIET,
        "run.dir=run",
        cwd=workdir,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    run = workdir / "run"
    assert (run / "checkpoints" / "last" / "state.ckpt").is_file()
    ckpt = torch.load(run / "checkpoints" / "last" / "state.ckpt", weights_only=True)
    assert ckpt["global_step"] == 15
    got = losses(run)
    assert sorted(got) == list(range(15))
    assert got[14] < got[0] - 0.3, "the loss goes down"


def test_digits_reaches_the_documented_accuracy(workdir):
    result = fw("train", "experiment=digits_accuracy", *QUIET, "run.dir=run", cwd=workdir)
    assert result.returncode == 0, result.stderr[-3000:]
    accs = [float(r["val/acc"]) for r in read_metrics(workdir / "run") if r.get("val/acc")]
    assert len(accs) == 10 and accs[-1] > 0.9, accs


@pytest.mark.parametrize("devices", [1, 2])
def test_gpt_trains_and_samples(devices, workdir):
    result = fw(
        "train",
        "experiment=gpt_tiny",
        f"trainer.devices={devices}",
        *QUIET,
        "run.dir=run",
        cwd=workdir,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    run = workdir / "run"
    rows = read_metrics(run)
    train = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    val = [float(r["val/loss"]) for r in rows if r.get("val/loss")]
    assert len(train) == 4 and len(val) == 2
    assert train[-1] < train[0], "loss goes down"
    meta = json.loads((run / "checkpoints" / "last" / "meta.json").read_text())
    assert meta["step"] == 20 and meta["metrics"]["val/loss"] == pytest.approx(val[-1])
    sample = (run / "sample.txt").read_text(errors="replace")
    assert sample.startswith("def main(") and len(sample.encode(errors="replace")) >= 80
    assert "Sampled continuation" in result.stderr


def test_gpt_reads_any_text_file(workdir):
    corpus = workdir / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 400)  # 18000 bytes
    result = fw(
        "train",
        "experiment=gpt_tiny",
        f"task.data.path={corpus}",
        "trainer.max_steps=-1",
        "trainer.max_epochs=1",
        "trainer.val_check_interval=null",
        *QUIET,
        "run.dir=run",
        cwd=workdir,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # one epoch of this file: 95% of 18000 bytes in blocks of 64 (+1), batches of 8, ragged
    # batch dropped. The default corpus (200000 stdlib bytes) would give 371 steps.
    blocks = (int(18000 * 0.95) - 1) // 64
    meta = json.loads((workdir / "run" / "checkpoints" / "last" / "meta.json").read_text())
    assert meta["step"] == blocks // 8 == 33
    assert any(r.get("val/loss") for r in read_metrics(workdir / "run"))
