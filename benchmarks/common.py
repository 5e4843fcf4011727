"""Helpers shared by the benchmark scripts: paths, the machine's description, results files."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
FW = str(Path(sys.executable).with_name("fw"))


def machine() -> dict:
    """What the figures were measured on."""
    import lightning
    import torch

    return {
        "cpu_cores": os.cpu_count(),
        "processor": cpu_model(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
    }


def cpu_model() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    return platform.processor() or platform.machine()


def load_average() -> float:
    """The 1-minute load average: other work on the machine slows and scatters every figure."""
    return round(os.getloadavg()[0], 2)


def save_results(name: str, results: dict, load_at_start: float) -> None:
    """Write benchmarks/results/<name>.json with the machine and its load; print where it went."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    load = {"at_start": load_at_start, "at_end": load_average()}
    record = {"machine": machine(), "load_average_1_min": load, **results}
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(
        f"load average (1 min) at start / end: {load['at_start']} / {load['at_end']} "
        f"on {os.cpu_count()} cores; results: {path.relative_to(ROOT)}"
    )


def train_command(
    run_dir: str, steps: int, devices: int, *args: str, accelerator: str = "cpu"
) -> list[str]:
    """`fw train` for a benchmark (on CPU unless `accelerator` says otherwise): no progress bar,
    summary, validation or callbacks."""
    return [
        FW,
        "train",
        *args,
        f"trainer.devices={devices}",
        f"trainer.accelerator={accelerator}",
        f"trainer.max_steps={steps}",
        "trainer.limit_val_batches=0",
        "trainer.enable_progress_bar=false",
        "trainer.enable_model_summary=false",
        "callbacks=none",
        "logger=[csv]",
        f"run.dir={run_dir}",
    ]


def step_timer_args(out_dir: str) -> list[str]:
    """`fw train` overrides adding the StepTimer callback, which writes to `out_dir`."""
    return [
        "+callbacks.timer._target_=benchmarks.step_timer.StepTimer",
        f"+callbacks.timer.path={out_dir}/times-RANK.json",
    ]


def step_durations(out_dir: str) -> list[float]:
    """Rank 0's duration of every training step (seconds), as the StepTimer recorded them."""
    times = json.loads((Path(out_dir) / "times-0.json").read_text())
    return [end - start for start, end in zip(times["starts"], times["ends"], strict=True)]


def run_checked(command: list[str], what: object, env: dict[str, str] | None = None) -> None:
    """Run a benchmark's command from the repository root (in `env`, default: this process's
    environment); RuntimeError with its stderr tail."""
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{what} failed:\n{done.stderr[-3000:]}")
