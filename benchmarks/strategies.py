"""Step time of each data-parallel strategy relative to ddp, on the same job and processes.

Each strategy trains the small GPT of the memory benchmark (`benchmarks/memory.py`: 4 layers of
width 256, Ψ ≈ 3.26 M parameters, batch 4 per process of 256 tokens) for 40 steps with 2 CPU
processes, one run at a time. The `StepTimer` callback records every step's start and end on each
rank; a strategy's step time is the median over steps 10-40 of rank 0 (the ranks wait for each
other in every collective, so all ranks see the same steps). Reported as the ratio to ddp.

Run from the repository root: `python -m benchmarks.strategies` (part of `make bench`).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import tempfile
from pathlib import Path

from benchmarks.common import ROOT, load_average, save_results, train_command
from benchmarks.memory import MODEL

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp")
PROCESSES = 2
STEPS = 40
WARMUP = 10


def step_times(strategy: str) -> list[float]:
    with tempfile.TemporaryDirectory(prefix="fw-bench-strategies-") as tmp:
        args = train_command(
            f"{tmp}/run",
            STEPS,
            PROCESSES,
            *MODEL,
            f"strategy={strategy}",
            "+callbacks.timer._target_=benchmarks.step_timer.StepTimer",
            f"+callbacks.timer.path={tmp}/times-RANK.json",
        )
        done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{strategy} failed:\n{done.stderr[-3000:]}")
        times = json.loads((Path(tmp) / "times-0.json").read_text())
    return [end - start for start, end in zip(times["starts"], times["ends"], strict=True)]


def main() -> None:
    load_at_start = load_average()
    rows = []
    for strategy in STRATEGIES:
        steps = step_times(strategy)[WARMUP:]
        rows.append({"strategy": strategy, "median_step_s": statistics.median(steps)})
    ddp = rows[0]["median_step_s"]
    print(f"{PROCESSES} CPU processes, median step over steps {WARMUP}-{STEPS}")
    print("strategy   step (ms)   vs ddp")
    for row in rows:
        row["ratio_to_ddp"] = round(row["median_step_s"] / ddp, 3)
        print(
            f"{row['strategy']:<8} {row['median_step_s'] * 1e3:>10.1f} {row['ratio_to_ddp']:>8.3f}"
        )
    results = {
        "processes": PROCESSES,
        "steps": STEPS,
        "warmup": WARMUP,
        "model": MODEL,
        "rows": rows,
    }
    save_results("strategies", results, load_at_start)


if __name__ == "__main__":
    main()
