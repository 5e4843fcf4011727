"""Step time of Muon (`framework.optim.Muon`) against AdamW under fsdp on 2 CPU processes.

The job: the memory benchmark's small GPT (`benchmarks/memory.py`: `task=gpt`, 4 layers of width
256, 4 heads, sequences of 128 bytes, Ψ ≈ 3.26 M parameters, batch 4 per process), fp32,
`strategy=fsdp trainer.devices=2`, 40 steps, the same data and seed on every side. The sides
differ in `task.optimizer` alone:

- adamw: the recipe's torch.optim.AdamW;
- muon: `task.optimizer._target_=framework.optim.Muon` (Muon on the hidden matrices, AdamW on
  the rest; Newton-Schulz in bf16, torch's default): each matrix is gathered whole on one rank,
  orthogonalised there and sent back in parts, one all-to-all each way;
- muon fp32: the same with `+task.optimizer.ns_dtype=float32` (the setting under which every
  layout reproduces one process within 1e-5).

The runs alternate (adamw, muon, muon fp32, adamw, ...), so load on the machine falls on every
side alike. `StepTimer` records rank 0's every step (forward, backward and the optimizer step;
the ranks wait for each other in every collective); a side's figure is the median over the timed
steps (10-40) of all its runs, reported with its ratio to AdamW's.

Run from the repository root: `python -m benchmarks.muon` (part of `make bench`; `--repeats N`,
default 3: about 5 minutes on 2 quiet cores). Results: benchmarks/results/muon.json.
"""

from __future__ import annotations

import argparse
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

PROCESSES = 2
STEPS = 40
WARMUP = 10
MUON = "task.optimizer._target_=framework.optim.Muon"
SIDES = {
    "adamw": [],
    "muon": [MUON],
    "muon fp32": [MUON, "+task.optimizer.ns_dtype=float32"],
}
BASE = "adamw"


def step_times(extra: list[str]) -> list[float]:
    """Rank 0's timed steps (seconds) of one fsdp x2 run with `extra` overrides."""
    with tempfile.TemporaryDirectory(prefix="fw-bench-muon-") as tmp:
        command = train_command(
            f"{tmp}/run",
            STEPS,
            PROCESSES,
            *MODEL,
            "task.model.sample_length=0",
            "strategy=fsdp",
            *extra,
            *step_timer_args(tmp),
        )
        run_checked(command, " ".join(["fw train strategy=fsdp", *extra]))
        return step_durations(tmp)[WARMUP:]


def summarise(runs: dict[str, list[list[float]]]) -> dict[str, dict]:
    """Per side: the median over all its timed steps, each run's median, the ratio to AdamW."""
    rows = {
        name: {
            "median_step_s": statistics.median(s for run in done for s in run),
            "median_step_s_per_run": [statistics.median(run) for run in done],
        }
        for name, done in runs.items()
    }
    base = rows[BASE]["median_step_s"]
    for row in rows.values():
        row["ratio_to_adamw"] = row["median_step_s"] / base
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs of each side")
    parser.add_argument("--no-save", action="store_true", help="print only")
    args = parser.parse_args(argv)
    load_at_start = load_average()
    runs: dict[str, list[list[float]]] = {name: [] for name in SIDES}
    for repeat in range(args.repeats):
        for name, extra in SIDES.items():
            runs[name].append(step_times(extra))
            shown = statistics.median(runs[name][-1]) * 1e3
            print(f"run {repeat + 1}/{args.repeats} {name}: median step {shown:.1f} ms", flush=True)
    rows = summarise(runs)
    print(
        f"fsdp x{PROCESSES} CPU processes, median of rank 0's steps {WARMUP}-{STEPS} "
        f"over {args.repeats} runs per side"
    )
    print("optimizer    step (ms)   vs AdamW")
    for name, row in rows.items():
        print(f"{name:<10} {row['median_step_s'] * 1e3:>11.1f} {row['ratio_to_adamw']:>10.3f}")
    if not args.no_save:
        results = {
            "processes": PROCESSES,
            "strategy": "fsdp",
            "steps": STEPS,
            "warmup": WARMUP,
            "repeats": args.repeats,
            "model": MODEL,
            "sides": SIDES,
            "rows": rows,
        }
        save_results("muon", results, load_at_start)


if __name__ == "__main__":
    main()
