"""Helpers shared by the benchmark scripts: paths, the machine's description, results files."""

from __future__ import annotations

import json
import os
import platform
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
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        # Other work on the machine slows every figure; an average above cpu_cores is a warning.
        "load_average_1_5_15_min": [round(x, 2) for x in os.getloadavg()],
    }


def write_results(name: str, results: dict) -> Path:
    """Write benchmarks/results/<name>.json and return its path."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"machine": machine(), **results}, indent=2) + "\n")
    return path
