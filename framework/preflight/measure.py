"""`fw plan --measure K`: run the first K layouts of the plan here, each a `fw train` of a few
steps, and put the measured step time and tokens/s next to the predicted ones.

Each run is the layout's own command (`fw train OVERRIDES LAYOUT WORLD`) with a short
`trainer.max_steps`, the CSV logger, no validation and no checkpoints; the throughput callback
averages every `WINDOW` optimizer steps, and the median of the windows after the first (which
holds the warm-up) is the measured figure.
"""

from __future__ import annotations

import csv
import os
import statistics
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from framework.processes import python

WINDOW = 5
WINDOWS = 8  # the first is warm-up; the median of the other seven is reported (steps scatter by
# +-30% on two shared cores: three windows of five left a layout's figure 10-15% off from run to run)


def measure_command(overrides: list[str], world: list[str], run_dir: Path) -> list[str]:
    """The layout's `fw train` (`python -P`: a `torch.py` in the working directory is not
    imported; fw appends the directory, so the user's modules are still found)."""
    steps = 1 + WINDOW * WINDOWS  # the throughput callback's first batch counts FLOPs, unwindowed
    return [
        *python("-m", "framework.cli", "train"), *overrides, *world,
        f"trainer.max_steps={steps}", "trainer.limit_val_batches=0",
        f"trainer.log_every_n_steps={WINDOW}", "trainer.enable_progress_bar=false",
        "trainer.enable_model_summary=false", "~callbacks.checkpoint",
        f"callbacks.throughput.window={WINDOW}", "logger=[csv]", f"run.dir={run_dir}",
    ]  # fmt: skip


def measured(run_dir: Path) -> dict[str, float]:
    """Median step seconds and tokens/s of the windows after the first, from metrics.csv."""
    with open(run_dir / "metrics.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get("perf/steps_per_sec")]
    later = rows[1:] or rows
    if not later:
        raise RuntimeError(f"{run_dir}/metrics.csv has no perf/steps_per_sec")
    step = statistics.median(1 / float(r["perf/steps_per_sec"]) for r in later)
    tokens = [float(r["perf/tokens_per_sec"]) for r in later if r.get("perf/tokens_per_sec")]
    return {"step_s": step, "tokens_per_s": statistics.median(tokens) if tokens else 0.0}


def measure_rows(rows: list[dict[str, Any]], world: list[str], dirs: list[Path]) -> None:
    """Run each row's layout here; its `measured` entry gets step_s, tokens_per_s and the
    ratio predicted / measured of the step time."""
    extra = [f"--config-dir={d}" for d in dirs]
    # the workers' threads as `fw calibrate` measured them: the cores shared out (worker.py)
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    for row in rows:
        with tempfile.TemporaryDirectory(prefix="fw-plan-measure-") as tmp:
            run_dir = Path(tmp) / "run"
            done = subprocess.run(
                [*measure_command([*extra, *row["overrides"]], world, run_dir)],
                capture_output=True,
                text=True,
                check=False,
                env=env,
            )
            if done.returncode != 0:
                tail = done.stderr.strip().splitlines()[-1:] or ["no output"]
                row["measured"] = {"error": f"fw train exited {done.returncode}: {tail[0]}"}
                continue
            found = measured(run_dir)
        found["predicted_over_measured"] = row["step_s"] / found["step_s"]
        row["measured"] = found


def comparison(rows: list[dict[str, Any]]) -> str:
    """Predicted against measured, one line per measured layout."""
    lines = ["Predicted against measured here (step seconds; tokens/s):"]
    head = ("layout", "predicted s", "measured s", "predicted/measured", "measured tokens/s")
    table = [head]
    for r in rows:
        m = r.get("measured")
        if m is None:
            continue
        if "error" in m:
            table.append((r["layout"], f"{r['step_s']:.4g}", "-", "-", m["error"]))
            continue
        table.append(
            (
                r["layout"],
                f"{r['step_s']:.4g}",
                f"{m['step_s']:.4g}",
                f"{m['predicted_over_measured']:.2f}",
                f"{m['tokens_per_s']:.4g}",
            )
        )
    widths = [max(len(t[i]) for t in table) for i in range(len(head))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(t, widths, strict=True)).rstrip() for t in table]
    return "\n".join(lines)
