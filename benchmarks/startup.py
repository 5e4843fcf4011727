"""Seconds from launching `fw train` to its first training step, against plain Lightning.

For one and two processes, each side is launched REPEATS times, alternating: `fw train
task=digits` and `python -m benchmarks.plain_lightning` (the same model written the usual
Lightning way, `strategy="ddp"` for two processes). The launcher puts time.time() in $BENCH_T0
just before starting the command; a FirstStep callback on rank 0 writes the seconds elapsed when
batch 0 starts, then training goes on to max_steps=2. Both sides keep their default logger and
checkpointing. The figures are medians; total is the time until the command exits.

Run from the repository root: `python -m benchmarks.startup` (or `make bench`).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import FW, ROOT, load_average, save_results

DEVICES = (1, 2)
REPEATS = 3
TARGET_DIFFERENCE_S = 1.0


def fw_command(devices: int, workdir: Path, first_step: Path) -> list[str]:
    return [
        FW,
        "train",
        "task=digits",
        f"trainer.devices={devices}",
        "trainer.accelerator=cpu",
        "trainer.max_steps=2",
        "trainer.enable_progress_bar=false",
        f"run.dir={workdir / 'run'}",
        "+callbacks.first_step._target_=benchmarks.step_timer.FirstStep",
        f"+callbacks.first_step.path={first_step}",
    ]


def plain_command(devices: int, workdir: Path, first_step: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "benchmarks.plain_lightning",
        f"--devices={devices}",
        "--max-steps=2",
        f"--first-step={first_step}",
        f"--root={workdir}",
    ]


def launch(command, devices: int) -> tuple[float, float]:
    """(seconds to the first training step, seconds until the command exited)."""
    with tempfile.TemporaryDirectory(prefix="fw-bench-") as tmp:
        first_step = Path(tmp) / "first_step"
        args = command(devices, Path(tmp), first_step)
        t0 = time.time()
        subprocess.run(
            args,
            cwd=ROOT,
            env={**os.environ, "BENCH_T0": repr(t0)},
            check=True,
            capture_output=True,
        )
        total = time.time() - t0
        return float(first_step.read_text()), total


def main() -> None:
    load_at_start = load_average()
    sides = {"fw": fw_command, "plain": plain_command}
    runs = {f"{side}_{n}": [] for n in DEVICES for side in sides}
    for repeat in range(REPEATS):
        for n in DEVICES:
            for side, command in sides.items():
                runs[f"{side}_{n}"].append(launch(command, n))
        print(f"repeat {repeat + 1}/{REPEATS} done")
    rows = {}
    for n in DEVICES:
        fw = statistics.median(first for first, _ in runs[f"fw_{n}"])
        plain = statistics.median(first for first, _ in runs[f"plain_{n}"])
        rows[n] = {
            "fw_first_step_s": fw,
            "plain_first_step_s": plain,
            "difference_s": fw - plain,
            "ratio": fw / plain,
            "fw_total_s": statistics.median(total for _, total in runs[f"fw_{n}"]),
            "plain_total_s": statistics.median(total for _, total in runs[f"plain_{n}"]),
            "fw_runs": runs[f"fw_{n}"],
            "plain_runs": runs[f"plain_{n}"],
        }
    print()
    print(
        f"{'processes':>9}{'fw (s)':>9}{'plain (s)':>11}{'fw - plain':>12}{'ratio':>7}"
        f"{'total fw / plain (s)':>23}"
    )
    for n, row in rows.items():
        print(
            f"{n:>9}{row['fw_first_step_s']:>9.2f}{row['plain_first_step_s']:>11.2f}"
            f"{row['difference_s']:>+12.2f}{row['ratio']:>7.2f}"
            f"{row['fw_total_s']:>15.2f} / {row['plain_total_s']:.2f}"
        )
    print(f"target: fw - plain <= {TARGET_DIFFERENCE_S} s (seconds to the first training step)")
    results = {
        "task": "digits",
        "repeats": REPEATS,
        "target_difference_s": TARGET_DIFFERENCE_S,
        "by_processes": rows,
    }
    save_results("startup", results, load_at_start)


if __name__ == "__main__":
    main()
