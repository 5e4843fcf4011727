"""benchmarks.gpu: the CPU smoke (fw and the hand-written loop compute the same losses, bitwise;
the float8 row runs, emulated, with the GPU run's overrides) and, on a CUDA machine, a short run
of the real benchmark (skipped, with the reason, elsewhere)."""

from __future__ import annotations

import re

import pytest

from benchmarks.gpu import FLOAT8, LABELS
from tests.benchmarks import run_benchmark

pytestmark = pytest.mark.slow


def test_smoke_fw_and_the_plain_loop_lose_the_same_bitwise():
    done = run_benchmark("gpu", "--smoke", timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "smoke: per-step losses of fw and plain bitwise equal over 8 steps" in done.stdout
    rows = {
        n: next(r for r in done.stdout.splitlines() if r.startswith(LABELS[n]))
        for n in ("plain", "fw")
    }
    assert rows["fw"].split()[-1] == "0", f"largest loss difference to the loop: {rows['fw']}"
    assert rows["plain"].split()[-1] == "reference", "the loop is not compared with itself"
    # the float8 row (the GPU run's trainer.float8=tensorwise, emulated here) ran: float8
    # rounding moves its losses, a little
    assert re.search(r"the float8 row's per-step losses within 0\.\d+% of fw's", done.stdout)
    float8 = next(r for r in done.stdout.splitlines() if r.startswith(LABELS[FLOAT8]))
    assert 0 < float(float8.split()[-1]) < 0.05, float8
    assert "results:" not in done.stdout, "the smoke saves nothing"


@pytest.mark.gpu
def test_real_benchmark_runs_briefly_on_cuda():
    done = run_benchmark(
        "gpu", "--steps", "30", "--warmup", "10", "--repeats", "1", "--no-save", timeout=3000
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    for name, label in LABELS.items():
        if name == FLOAT8 and "float8 row left out: compute capability" in done.stdout:
            continue  # a GPU before Ada/Hopper has no float8 matmuls
        row = next(line for line in lines if line.startswith(label))
        assert "failed" not in row, row
    fw = next(line for line in lines if line.startswith(LABELS["fw"]))
    assert float(fw.split()[-1]) < 0.05, f"fw's losses follow the loop's: {fw}"
    assert re.search(r"goal MFU >= 45% \(fw\): \d+\.\d%", done.stdout), done.stdout[-2000:]
