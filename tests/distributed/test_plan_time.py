"""`fw calibrate` then `fw plan --hardware FILE --measure 1`: the prediction made from this
machine's calibration is printed next to a real run of the same layout (issue 30). How close the
two are is a benchmark (benchmarks/plan_accuracy.py, figures in docs/preflight.md), not a test:
measured step times depend on the machine's load."""

from __future__ import annotations

import json

import pytest

from framework.preflight.hardware import read_calibration
from tests.conftest import fw

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
    assert set(device.host) == {"dtensor_op", "collective", "fsdp_unit"}, device.host
    assert device.host["dtensor_op"] > 0 and device.host["fsdp_unit"] > 0, device.host
    assert device.host["collective"] == device.intra.latency_s
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
    assert row["terms_s"]["host"] == 0.0  # a ddp replica dispatches no DTensor operation
