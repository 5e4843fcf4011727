"""Step time of each data-parallel strategy relative to ddp, on the same job and processes.

Each strategy trains the small GPT of the memory benchmark (`benchmarks/memory.py`: 4 layers of
width 256, Ψ ≈ 3.26 M parameters, batch 4 per process of 256 tokens) for 40 steps with 2 CPU
processes, one run at a time. The `StepTimer` callback records every step's start and end on each
rank; a strategy's step time is the median over steps 10-40 of rank 0 (the ranks wait for each
other in every collective, so all ranks see the same steps). Reported as the ratio to ddp.

Run from the repository root: `python -m benchmarks.strategies` (part of `make bench`).
"""

from __future__ import annotations

import statistics
import tempfile

from benchmarks.common import (
    load_average,
    run_checked,
    save_results,
    step_durations,
    step_timer_args,
    train_command,
)
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
            *step_timer_args(tmp),
        )
        run_checked(args, strategy)
        return step_durations(tmp)


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
