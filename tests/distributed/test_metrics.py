"""`callbacks.throughput`: counted FLOPs, TFLOP/s, MFU, tokens/s, memory and data wait reach
metrics.csv and the W&B run."""

from __future__ import annotations

import subprocess

import pytest

from framework.perf import transformer_flops_per_token
from tests.conftest import FW, QUIET, fw_env, read_metrics


def test_throughput_metrics_reach_the_csv_and_wandb(tmp_path):
    env = fw_env()
    env["WANDB_MODE"] = "offline"
    args = [
        *QUIET,
        "experiment=gpt_tiny",
        "task.data.batch_size=8",
        "trainer.max_steps=7",
        "trainer.log_every_n_steps=1",
        "trainer.peak_tflops=0.5",
        "callbacks.throughput.window=2",
        "logger=[csv,wandb]",
        "run.dir=run",
    ]
    result = subprocess.run(
        [str(FW), "train", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_metrics(tmp_path / "run")
    # gpt_tiny: 2 layers of width 64, sequence 64, vocabulary 256 (head tied to the embedding)
    layers, width, seq, vocab, batch = 2, 64, 64, 256, 8
    matmul_params = layers * 12 * width * width + vocab * width
    formula = transformer_flops_per_token(matmul_params, layers, seq, width) * batch * seq
    counted = {float(r["perf/flops_per_batch"]) for r in rows if r.get("perf/flops_per_batch")}
    assert len(counted) == 1 and counted.pop() == pytest.approx(formula, rel=0.05)
    speed = [r for r in rows if r.get("perf/tflops_per_device")]
    assert {int(r["step"]) for r in speed} >= {2, 4, 6}  # windows of 2 after the counted step
    for r in speed:
        tflops = float(r["perf/tflops_per_device"])
        assert float(r["perf/mfu"]) == pytest.approx(tflops / 0.5)
        assert float(r["perf/tokens_per_sec"]) == pytest.approx(
            64 * float(r["perf/samples_per_sec"])
        )
        assert float(r["perf/samples_per_sec"]) == pytest.approx(8 * float(r["perf/steps_per_sec"]))
        assert 0.05 < float(r["perf/memory_peak_gib"]) < 8
        assert float(r["perf/data_wait_ms"]) >= 0
    run = next((tmp_path / "run" / "wandb").glob("offline-run-*"))
    record = next(run.glob("run-*.wandb")).read_bytes()
    for key in (
        "perf/mfu",
        "perf/tflops_per_device",
        "perf/tokens_per_sec",
        "perf/memory_peak_gib",
    ):
        assert key.encode() in record, key


def test_a_loader_that_starves_the_step_is_named_in_a_warning(tmp_path):
    """320 ms a batch (32 samples of 10 ms): windows of 3 steps after the counted first one; the
    second window waits 0.64 s, the third brings it past the second of wait that matters."""
    args = [
        *QUIET,
        "task=digits",
        "task.data._target_=tests.tasks.SlowLoadingDigits",
        "~task.data.val_fraction",
        "+task.data.sample_sleep=0.01",
        "trainer.max_steps=10",
        "trainer.limit_val_batches=0",
        "callbacks.throughput.window=3",
        "trainer.log_every_n_steps=1",
        "callbacks.checkpoint=null",
        "logger=[csv]",
        "run.dir=run",
    ]
    result = subprocess.run(
        [str(FW), "train", *args],
        cwd=tmp_path,
        env=fw_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Training waits for data" in result.stderr, result.stderr[-3000:]
    assert "the loader of Slow with num_workers=0" in result.stderr
    assert result.stderr.count("Training waits for data") == 1, "once"
    # the last line names the half of a test that is missing: the data module's
    assert "Run finished at step 10. Outputs in " in result.stderr
    assert "; DigitsTask defines test_step but SlowLoadingDigits has no test_dataloader: " in (
        result.stderr
    )
    rows = [r for r in read_metrics(tmp_path / "run") if r.get("perf/data_wait_ms")]
    assert rows and all(float(r["perf/data_wait_ms"]) > 32 * 10 * 0.5 for r in rows)
