"""On a CUDA machine: every strategy trains gpt_tiny in bf16 on one GPU, through `fw` (skipped,
with the reason, where CUDA is absent; see the `gpu` marker hook in tests/conftest.py)."""

from __future__ import annotations

import math

import pytest

from tests.conftest import QUIET, fw, losses

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


@pytest.mark.parametrize("strategy", ["ddp", "zero2", "zero3", "fsdp", "tensor", "pipeline"])
def test_every_strategy_trains_in_bf16_on_one_gpu(strategy, workdir):
    result = fw(
        "train",
        f"strategy={strategy}",
        "experiment=gpt_tiny",
        "trainer=gpu",
        "trainer.devices=1",
        "trainer.max_steps=20",
        "trainer.log_every_n_steps=1",
        "logger=[csv]",
        *QUIET,
        "run.dir=run",
        cwd=workdir,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    got = losses(workdir / "run")
    assert sorted(got) == list(range(20))
    assert all(math.isfinite(v) for v in got.values())
    assert got[19] < got[0], "the loss goes down"
