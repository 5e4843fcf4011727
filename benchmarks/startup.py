"""Seconds from launching `fw train` to its first training step, against plain Lightning.

For one and two processes, each side is launched REPEATS times, alternating: `fw train
task=digits` and `python -m benchmarks.plain_lightning` (the same model written the usual
Lightning way, `strategy="ddp"` for two processes). The launcher puts time.time() in $BENCH_T0
just before starting the command; a FirstStep callback on rank 0 writes the seconds elapsed when
batch 0 starts, then training goes on to max_steps=2. Both sides keep checkpointing on and log to
CSV only. One more case measures fw with its default loggers (CSV and W&B, forced offline), to
show what W&B adds to startup. The figures
are medians (best is the fastest run, the least disturbed by other work on the machine); total
is the time until the command has exited.

Run from the repository root: `python -m benchmarks.startup` (or `make bench`).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

from benchmarks.common import FW, ROOT, load_average, save_results

DEVICES = (1, 2)
REPEATS = 3
TARGET_DIFFERENCE_S = 1.0


def fw_command(devices: int, workdir: Path, first_step: Path, loggers: list[str]) -> list[str]:
    return [
        FW,
        "train",
        "task=digits",
        f"trainer.devices={devices}",
        "trainer.accelerator=cpu",
        "trainer.max_steps=2",
        "trainer.enable_progress_bar=false",
        f"run.dir={workdir / 'run'}",
        *loggers,
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


def cases():
    """(name, processes, command) of each measured case, in the order they alternate."""
    for n in DEVICES:
        yield f"fw_{n}", n, partial(fw_command, loggers=["logger=[csv]"])
        yield f"plain_{n}", n, plain_command
    yield "fw_default_loggers_1", 1, partial(fw_command, loggers=[])


def launch(command, devices: int) -> tuple[float, float]:
    """(seconds to the first training step, seconds until the command exited)."""
    with tempfile.TemporaryDirectory(prefix="fw-bench-") as tmp:
        first_step = Path(tmp) / "first_step"
        args = command(devices, Path(tmp), first_step)
        env = {**os.environ, "WANDB_MODE": "offline", "BENCH_T0": repr(time.time())}
        subprocess.run(args, cwd=ROOT, env=env, check=True, capture_output=True)
        total = time.time() - float(env["BENCH_T0"])
        return float(first_step.read_text()), total


DRY_BUILD = """
import sys, time
from omegaconf import OmegaConf
from framework.config.compose import compose_config
from framework.config.dry_build import dry_build
from framework.config.validate import check_task
cfg = compose_config(sys.argv[1:])
OmegaConf.resolve(cfg)
check_task(cfg.task)  # what validation imported and checked before the dry build existed
t0 = time.perf_counter()
dry_build(cfg.task)
print(time.perf_counter() - t0)
"""


def dry_build_seconds(overrides: list[str]) -> float:
    """Seconds the dry build adds to `fw train`'s validation (median of REPEATS fresh processes)."""
    times = []
    for _ in range(REPEATS):
        out = subprocess.run(
            [sys.executable, "-c", DRY_BUILD, *overrides],
            cwd=ROOT,
            check=True,
            capture_output=True,
            text=True,
        )
        times.append(float(out.stdout.strip().splitlines()[-1]))
    return statistics.median(times)


def main() -> None:
    load_at_start = load_average()
    runs: dict[str, list[tuple[float, float]]] = {}
    for repeat in range(REPEATS):
        for name, n, command in cases():
            runs.setdefault(name, []).append(launch(command, n))
        print(f"repeat {repeat + 1}/{REPEATS} done")
    first = {name: statistics.median(f for f, _ in r) for name, r in runs.items()}
    total = {name: statistics.median(t for _, t in r) for name, r in runs.items()}
    best = {name: min(f for f, _ in r) for name, r in runs.items()}  # least disturbed by others
    print()
    print(
        f"{'processes':>9}{'fw (s)':>9}{'plain (s)':>11}{'fw - plain':>12}{'ratio':>7}"
        f"{'total fw / plain (s)':>23}"
    )
    for n in DEVICES:
        fw, plain = first[f"fw_{n}"], first[f"plain_{n}"]
        print(
            f"{n:>9}{fw:>9.2f}{plain:>11.2f}{fw - plain:>+12.2f}{fw / plain:>7.2f}"
            f"{total[f'fw_{n}']:>15.2f} / {total[f'plain_{n}']:.2f}"
        )
    defaults = first["fw_default_loggers_1"]
    print(
        f"1 process, fw with its default loggers (CSV + W&B offline): {defaults:.2f} s "
        f"({defaults - first['plain_1']:+.2f} s vs plain)"
    )
    print(f"target: fw - plain <= {TARGET_DIFFERENCE_S} s (seconds to the first training step)")
    dry = {name: dry_build_seconds(o) for name, o in (("digits", []), ("gpt", ["task=gpt"]))}
    print(
        "of which the dry build (task on the meta device, data module, optimizer, schedule): "
        + ", ".join(f"{k} {v:.3f} s" for k, v in dry.items())
    )
    results = {
        "task": "digits",
        "repeats": REPEATS,
        "target_difference_s": TARGET_DIFFERENCE_S,
        "first_step_s": first,
        "best_first_step_s": best,
        "total_s": total,
        "difference_s": {n: first[f"fw_{n}"] - first[f"plain_{n}"] for n in DEVICES},
        "dry_build_s": dry,
        "runs_first_step_and_total_s": runs,
    }
    save_results("startup", results, load_at_start)


if __name__ == "__main__":
    main()
