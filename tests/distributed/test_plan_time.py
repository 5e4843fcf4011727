"""`fw plan`'s predicted step time against measured runs on this machine (issue 30): `fw
calibrate` measures it, then `fw plan --hardware FILE --measure 1` predicts and runs each layout
of a GPT at 2 processes. Slow (a calibration and eight short trainings, several minutes on two
cores) and sensitive to other load on the machine: its figures are in docs/preflight.md."""

from __future__ import annotations

import json

import pytest

from tests.conftest import fw

GPT = [
    "task.model.n_layer=2",
    "task.model.n_embd=128",
    "task.model.block_size=128",
    "task.data.batch_size=8",
    "task.data.max_bytes=300000",
]
LAYOUTS = {
    "ddp": ["task=gpt", "strategy=ddp"],
    "zero2": ["task=gpt", "strategy=zero2"],
    "fsdp": ["task=gpt", "strategy=fsdp"],
    "tensor": ["task=gpt", "strategy=tensor", "strategy.tp=2"],
    "fsdp_tp": ["task=gpt", "strategy=fsdp_tp", "strategy.tp=2"],
    "pipeline": ["task=gpt", "strategy=pipeline", "strategy.schedule=1f1b",
                 "strategy.microbatches=4"],
    "expert": ["task=moe_gpt", "strategy=expert", "strategy.ep=2"],
    "diloco": ["task=gpt", "strategy=diloco"],
}  # fmt: skip
BOUND = 0.25


@pytest.mark.slow
def test_predicted_step_time_is_within_25_percent_of_measured(tmp_path):
    calibration = tmp_path / "calibration.json"
    done = fw("calibrate", "--out", str(calibration), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    ratios = {}
    for name, layout in LAYOUTS.items():
        args = ["plan", "--gpus", "2", "--hardware", str(calibration), "--json", "--measure", "1"]
        done = fw(*args, *layout, *GPT, timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]
        (row,) = json.loads(done.stdout)
        assert "error" not in row["measured"], row["measured"]
        ratios[name] = row["measured"]["predicted_over_measured"]
    print("predicted / measured step time:", json.dumps(ratios, indent=1))
    off = {k: round(v, 2) for k, v in ratios.items() if abs(v - 1) > BOUND}
    assert not off, f"outside +-{BOUND:.0%}: {off} (all: {ratios})"
