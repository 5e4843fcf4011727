"""`debug=profile` (callbacks.profile): a torch.profiler trace per rank of the scheduled steps, a
memory snapshot per rank on CUDA; the run's metrics.csv drawn by `fw plot`."""

from __future__ import annotations

import json
import pickle

import pytest

from framework.callbacks.profile.callback import fit_schedule
from tests.conftest import QUIET, fw

PROFILE = ["debug=profile", "logger=[csv]", "callbacks=none", *QUIET]


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    """One 2-process digits run under debug=profile (7 steps: wait 2, warmup 2, active 3)."""
    root = tmp_path_factory.mktemp("profile")
    result = fw("train", *PROFILE, "trainer.devices=2", "run.dir=run", cwd=root)
    assert result.returncode == 0, result.stderr[-3000:]
    return root / "run", result.stderr


def optimizer_steps_per_profiler_step(trace: dict) -> dict[str, int]:
    """{ProfilerStep#N: how many optimizer steps ran inside it}."""
    events = trace["traceEvents"]
    steps = [e for e in events if e.get("name", "").startswith("ProfilerStep")]
    updates = [e["ts"] for e in events if e.get("name", "").startswith("Optimizer.step#")]
    return {s["name"]: sum(s["ts"] <= t <= s["ts"] + s["dur"] for t in updates) for s in steps}


@pytest.mark.slow
def test_every_rank_writes_a_trace_of_the_active_steps(profiled):
    run, stderr = profiled
    assert sorted(p.name for p in (run / "profile").iterdir()) == [
        "trace-rank0.json",
        "trace-rank1.json",
    ], "one trace per rank, no memory snapshot on CPU"
    for rank in (0, 1):
        with (run / "profile" / f"trace-rank{rank}.json").open() as fh:
            trace = json.load(fh)
        assert len(trace["traceEvents"]) > 100
        assert optimizer_steps_per_profiler_step(trace) == {
            "ProfilerStep#4": 1,
            "ProfilerStep#5": 1,
            "ProfilerStep#6": 1,
        }, "three whole training steps"
        names = {e.get("name") for e in trace["traceEvents"]}
        assert {"aten::addmm", "AddmmBackward0", "gloo:all_reduce"} <= names, "DDP's step"
    assert "Profiler traces of steps 4-6" in stderr and "https://ui.perfetto.dev" in stderr


@pytest.mark.slow
def test_fw_plot_draws_a_real_run(profiled):
    import matplotlib.image

    from framework.cli import main

    run, _ = profiled
    assert main(["plot", str(run)]) == 0
    assert matplotlib.image.imread(run / "metrics.png").shape[:2] == (280, 800), "loss panel"


@pytest.mark.parametrize(
    "steps_left,want",
    [(7, (2, 2, 3)), (float("inf"), (2, 2, 3)), (5, (0, 2, 3)), (4, (0, 1, 3)), (2, (0, 0, 2))],
)
def test_a_short_run_traces_fewer_steps_wait_cut_first(steps_left, want):
    assert fit_schedule(2, 2, 3, steps_left) == want
    assert fit_schedule(2, 2, 3, 1) == (0, 0, 1), "at least one step is traced"


@pytest.mark.gpu
@pytest.mark.slow
def test_cuda_run_writes_a_memory_snapshot(workdir):
    result = fw("train", *PROFILE, "trainer=gpu", "trainer.devices=1", "run.dir=run", cwd=workdir)
    assert result.returncode == 0, result.stderr[-3000:]
    profile = workdir / "run" / "profile"
    with (profile / "memory-rank0.pickle").open("rb") as fh:
        snapshot = pickle.load(fh)
    assert snapshot["segments"] and any(snapshot["device_traces"]), "allocations recorded"
    with (profile / "trace-rank0.json").open() as fh:
        trace = json.load(fh)
    assert any(e.get("cat") == "kernel" for e in trace["traceEvents"]), "CUDA kernels traced"
    assert "https://pytorch.org/memory_viz" in result.stderr
