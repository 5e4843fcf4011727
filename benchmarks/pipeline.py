"""Pipeline parallel: measured bubble fraction against theory, and step time relative to ddp.

Bubble: `WideStack` (benchmarks/pipeline_task.py: 8 equal layers 2048 x 2048 on random rows, cut
in the middle with a split point so both stages cost the same) on 2 CPU processes, 128 rows per
microbatch (tens of ms forward, twice that backward, per stage), so a microbatch's cost is the
same whatever m is. The strategy logs
`pipeline/bubble` = 1 - (busy time of all stages) / (p x step wall time) every step; the median
over steps 3-15 is compared with (p - 1) / (m + p - 1) for gpipe and 1f1b, m = 2, 4, 8; the
interleaved and zero-bubble schedules (2 stages per process) run at the same m.

Step time: the gpt of the memory benchmark (4 layers of width 256, batch 8 of 256 tokens per
data-parallel rank) under ddp on 2 processes and under pipeline pp=2 (1f1b, 4 microbatches),
median step over steps 10-30 from the StepTimer callback.

Run from the repository root: `python -m benchmarks.pipeline` (part of `make bench`). Writes
benchmarks/results/pipeline.json and, for docs/, the executed schedules as PNGs.
"""

from __future__ import annotations

import csv
import shutil
import statistics
import tempfile
from pathlib import Path

from benchmarks.common import (
    ROOT,
    load_average,
    run_checked,
    save_results,
    step_durations,
    step_timer_args,
    train_command,
)
from benchmarks.memory import MODEL

P = 2
MICROBATCH_ROWS = 128
STEPS = 15
WARMUP = 3
BUBBLE_CASES = [(s, m) for m in (2, 4, 8) for s in ("gpipe", "1f1b")] + [
    (s, m) for m in (4, 8) for s in ("interleaved_1f1b", "zero_bubble", "zbv")
]
PICTURES = {("gpipe", 4), ("1f1b", 4), ("interleaved_1f1b", 4), ("zbv", 4)}
IMG = ROOT / "docs" / "img"


def run(args: list[str], steps: int, tmp: str) -> Path:
    run_checked(train_command(f"{tmp}/run", steps, P, *args), args)
    return Path(tmp) / "run"


def bubble(schedule: str, m: int) -> float:
    virtual = 1 if schedule in ("gpipe", "1f1b") else 2
    split = "[net.5]" if virtual == 1 else "[net.3,net.5,net.7]"
    with tempfile.TemporaryDirectory(prefix="fw-bench-pipeline-") as tmp:
        out = run(
            [
                "task=digits",
                "task._target_=benchmarks.pipeline_task.WideStack",
                "~task.model.hidden",
                "~task.model.dropout",
                "task.data._target_=benchmarks.pipeline_task.RandomRows",
                "~task.data.val_fraction",
                f"task.data.batch_size={MICROBATCH_ROWS * m}",
                "+task.data.n=16384",
                "strategy=pipeline",
                f"strategy.schedule={schedule}",
                f"strategy.microbatches={m}",
                f"strategy.virtual_stages={virtual}",
                f"strategy.split_points={split}",
                f"strategy.trace={str((schedule, m) in PICTURES).lower()}",
                "strategy.trace_step=5",
                "trainer.log_every_n_steps=1",
            ],
            STEPS,
            tmp,
        )
        with open(out / "metrics.csv") as f:
            rows = [r for r in csv.DictReader(f) if r.get("pipeline/bubble")]
        values = [float(r["pipeline/bubble"]) for r in rows if int(r["step"]) >= WARMUP]
        if (schedule, m) in PICTURES:
            shutil.copy(out / "pipeline_schedule.png", IMG / f"pipeline_{schedule}.png")
    return statistics.median(values)


def step_time(args: list[str]) -> float:
    with tempfile.TemporaryDirectory(prefix="fw-bench-pipeline-") as tmp:
        run([*MODEL, "task.data.batch_size=8", *args, *step_timer_args(tmp)], 30, tmp)
        return statistics.median(step_durations(tmp)[10:])


def main() -> None:
    load_at_start = load_average()
    IMG.mkdir(parents=True, exist_ok=True)
    rows = []
    print(f"p={P}, {MICROBATCH_ROWS} rows per microbatch, median over steps {WARMUP}-{STEPS}")
    print("schedule           m   measured   theory   diff")
    for schedule, m in BUBBLE_CASES:
        measured = bubble(schedule, m)
        theory = (P - 1) / (m + P - 1)
        rows.append(
            {
                "schedule": schedule,
                "microbatches": m,
                "bubble": round(measured, 4),
                "theory_gpipe_1f1b": round(theory, 4),
                "diff": round(measured - theory, 4),
            }
        )
        print(f"{schedule:<17} {m:>2} {measured:>10.3f} {theory:>8.3f} {measured - theory:>+7.3f}")
    ddp = step_time(["strategy=ddp"])
    pp = step_time(["strategy=pipeline", "strategy.microbatches=4"])
    print(
        f"step time, gpt 3.26 M, 2 processes: ddp {ddp * 1e3:.1f} ms, pp=2 1f1b m=4 "
        f"{pp * 1e3:.1f} ms, ratio {pp / ddp:.3f}"
    )
    save_results(
        "pipeline",
        {
            "bubble": rows,
            "step_time": {
                "ddp_s": ddp,
                "pipeline_1f1b_m4_s": pp,
                "ratio_to_ddp": round(pp / ddp, 3),
            },
        },
        load_at_start,
    )


if __name__ == "__main__":
    main()
