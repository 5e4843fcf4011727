"""benchmarks.scaling --smoke under ddp: 1 and 2 processes train, the gloo all-reduce is timed,
and the table holds the step times, the efficiency and the communication estimate."""

from __future__ import annotations

import pytest

from tests.benchmarks import run_benchmark

pytestmark = pytest.mark.slow


def test_scaling_smoke_measures_ddp_and_the_allreduce():
    done = run_benchmark("scaling", "--smoke", "--strategies", "ddp", timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    row = next(line for line in done.stdout.splitlines() if line.startswith("ddp "))
    one, two, efficiency, _, difference, comm = (float(v) for v in row.split()[1:])
    assert one > 0 and two > 0
    assert efficiency == pytest.approx(one / two, rel=0.03)
    assert difference == pytest.approx(two - one, abs=0.2)
    assert comm > 0, "the all-reduce was timed"
    assert "gloo all_reduce of 0.5 MB between 2 processes" in done.stdout
    assert "results:" not in done.stdout, "the smoke saves nothing"
