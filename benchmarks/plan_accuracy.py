"""`fw plan`'s predicted step time against measured runs on this machine (issue 30): `fw
calibrate` measures the machine, then `fw plan --gpus 2 --hardware FILE --measure 1` predicts and
runs each layout of a small GPT (moe_gpt for expert parallel) at 2 processes, and the ratios
predicted / measured are printed side by side. The goal is every ratio within 1 +- 0.25 on a quiet
machine; a loaded machine scatters the measured steps (the load is recorded with the results).

Run: python -m benchmarks.plan_accuracy (a calibration and eight short trainings, several minutes
on two cores).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import ROOT, load_average, save_results

GPT = [
    "task.model.n_layer=2",
    "task.model.n_embd=128",
    "task.model.block_size=128",
    "task.data.batch_size=8",
    "task.data.max_bytes=300000",
]
LAYOUTS = {
    "ddp": ["task=gpt", "strategy=ddp"],
    "zero2": ["task=gpt", "strategy=zero2"],
    "fsdp": ["task=gpt", "strategy=fsdp"],
    "tensor": ["task=gpt", "strategy=tensor", "strategy.tp=2"],
    "fsdp_tp": ["task=gpt", "strategy=fsdp_tp", "strategy.tp=2"],
    "pipeline": ["task=gpt", "strategy=pipeline", "strategy.schedule=1f1b",
                 "strategy.microbatches=4"],
    "expert": ["task=moe_gpt", "strategy=expert", "strategy.ep=2"],
    "diloco": ["task=gpt", "strategy=diloco"],
}  # fmt: skip
BOUND = 0.25
FW = [sys.executable, "-m", "framework.cli"]


def run(args: list[str], cwd: Path) -> str:
    done = subprocess.run([*FW, *args], cwd=cwd, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"fw {' '.join(args)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done.stdout


def main() -> None:
    load = load_average()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        calibration = work / "calibration.json"
        run(["calibrate", "--out", str(calibration)], work)
        rows = {}
        for name, layout in LAYOUTS.items():
            plan = ["plan", "--gpus", "2", "--hardware", str(calibration), "--json"]
            out = run([*plan, "--measure", "1", *layout, *GPT], work)
            (row,) = json.loads(out)
            measured = row["measured"]
            rows[name] = {
                "predicted_s": row["step_s"],
                "measured": measured,
                "ratio": measured.get("predicted_over_measured"),
            }
    print(f"{'layout':10} {'predicted / measured':>22}")
    for name, row in rows.items():
        ratio = row["ratio"]
        mark = "" if ratio is not None and abs(ratio - 1) <= BOUND else "  (outside +-25%)"
        shown = f"{ratio:.2f}" if ratio is not None else str(row["measured"])
        print(f"{name:10} {shown:>22}{mark}")
    save_results("plan_accuracy", {"bound": BOUND, "layouts": rows}, load)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
