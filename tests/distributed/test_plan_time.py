"""`fw calibrate` then `fw plan --hardware FILE --measure 1`: the prediction made from this
machine's calibration is printed next to a real run of the same layout (issue 30). How close the
two are is a benchmark (benchmarks/plan_accuracy.py, figures in docs/preflight.md), not a test:
measured step times depend on the machine's load. The receives the plan charges a pipeline a
latency for are those torch's schedules post."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from framework.preflight.hardware import read_calibration
from framework.preflight.traffic import pipeline_receives
from tests.conftest import REPO, fw, fw_env

GPT = [
    "task=gpt",
    "strategy=ddp",
    "task.model.n_layer=2",
    "task.model.n_embd=128",
    "task.model.block_size=128",
    "task.data.batch_size=8",
    "task.data.max_bytes=300000",
]


@pytest.mark.slow
def test_a_calibration_feeds_the_plan_and_measure_runs_the_layout(tmp_path):
    calibration = tmp_path / "calibration.json"
    done = fw("calibrate", "--out", str(calibration), cwd=tmp_path, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    device = read_calibration(str(calibration))  # a file fw plan --hardware accepts
    # the host's costs per call of what a layout adds in Python (perf.py's host term)
    assert set(device.host) == {"dtensor_op", "collective", "fsdp_unit", "step"}, device.host
    assert device.host["dtensor_op"] > 0 and device.host["fsdp_unit"] > 0, device.host
    assert device.host["collective"] == device.intra.latency_s
    # a collective's time by its message's size, as the link's
    assert set(device.intra.allreduce_s) == {str(2**k) for k in range(10, 25, 2)}
    # a c10d all-reduce's wait after a short and a long stretch of compute, and what a
    # functional collective adds to a tensor-parallel step at two widths (2 processes on this
    # machine's 2 cores: each has a core, so the waits are measured)
    assert set(device.waits) == {"c10d", "functional"}, device.waits
    assert set(device.waits["c10d"]) == {"0.002", "0.02"}, device.waits
    gaps = sorted(float(gap) for gap in device.waits["functional"])
    assert len(gaps) == 2 and 0 < gaps[0] < gaps[1], device.waits  # the wider, the more compute
    assert all(s > 0 for s in device.waits["functional"].values()), device.waits
    # a transformer's matmuls' share of the probe's rate and its other operations' GB/s, by size
    assert len(device.matmul_share) == 4 and all(0 < s < 2 for s in device.matmul_share.values())
    assert len(device.elementwise_gb_per_s) == 4, device.elementwise_gb_per_s
    assert all(rate > 0 for rate in device.elementwise_gb_per_s.values())
    # fused attention's own rate, forward and backward, by dtype
    assert set(device.attention_tflops) == {"fp32", "bf16", "fp16"}, device.attention_tflops
    assert all(rate > 0 for rate in device.attention_tflops.values()), device.attention_tflops
    args = ["plan", "--gpus", "2", "--hardware", str(calibration), "--json", "--measure", "1"]
    done = fw(*args, *GPT, cwd=tmp_path, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    (row,) = json.loads(done.stdout)
    assert "strategy=ddp" in " ".join(row["overrides"]), row["overrides"]
    measured = row["measured"]
    assert "error" not in measured, measured
    assert row["step_s"] > 0 and measured["step_s"] > 0, row
    assert measured["predicted_over_measured"] == pytest.approx(row["step_s"] / measured["step_s"])
    assert measured["tokens_per_s"] > 0, measured
    # a ddp replica dispatches no DTensor operation: only the training loop's own work
    assert row["terms_s"]["host"] == pytest.approx(device.host["step"])


@pytest.mark.slow
def test_the_plan_charges_the_pipeline_the_receives_its_schedule_waits_on(tmp_path):
    """The busiest pipeline rank's blocking receives in a step, as perf.py's communication term
    charges them (a latency each), against the receives torch's schedules post in 3 processes:
    m for either rank of a 1f1b or gpipe pipeline of 2, 2m for the middle rank of 3, m(2v - 1)
    for an interleaved pipeline of 2 with v stages a rank."""
    script = REPO / "tests" / "distributed" / "scripts" / "pipeline_receives.py"
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3"]
    done = subprocess.run(
        [*launch, str(script), str(tmp_path)],
        env=fw_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    cases = {"1f1b pp2": (2, 4, 1), "gpipe pp2": (2, 4, 1), "1f1b pp3": (3, 4, 1)}
    cases["interleaved_1f1b pp2"] = (2, 4, 2)
    for name, (pp, micro, virtual) in cases.items():
        busiest = max(found[name] for found in ranks)
        assert busiest == pipeline_receives(pp, micro, virtual), (name, [r[name] for r in ranks])
