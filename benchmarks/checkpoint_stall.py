"""How long training waits for a checkpoint: synchronous against `callbacks.checkpoint.async_save`.

The gpt recipe at a size whose checkpoint (model + AdamW state) takes a second or more to write
(8 layers, width 768: about 57 M parameters, 0.7 GB of state), under `strategy=fsdp` on 2
processes, saves every 2 steps. Each checkpoint's meta.json records `stall_s`: what rank 0 waited
from the start of the save until the state was written (synchronous) or copied for the background
writer (async, plus any earlier write still in flight). The commit (digests, rename) comes after
it: synchronous saves pay it in the training thread, async ones in a background thread. So the
whole run's wall time is reported too, side by side. Sync and async runs alternate.

Run from the repository root: `python -m benchmarks.checkpoint_stall` (or `make bench`).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from benchmarks.common import load_average, save_results, train_command

REPEATS = 2
STEPS, EVERY = 6, 2
MODEL = [
    "task=gpt",
    "task.model.n_layer=8",
    "task.model.n_embd=768",
    "task.model.n_head=8",
    "task.model.block_size=64",
    "task.data.block_size=64",
    "task.data.batch_size=2",
    "strategy=fsdp",
]


def run(async_save: bool, root: Path) -> tuple[list[float], float, float]:
    """One run: every checkpoint's stall and the run's wall time (seconds), and the size of
    its last checkpoint (GB)."""
    run_dir = root / f"{'async' if async_save else 'sync'}-{time.monotonic_ns()}"
    command = train_command(
        str(run_dir),
        STEPS,
        2,
        *MODEL,
        "+callbacks.checkpoint.kind=checkpoint",
        f"+callbacks.checkpoint.every_n_steps={EVERY}",
        f"+callbacks.checkpoint.async_save={str(async_save).lower()}",
        "+callbacks.checkpoint.keep_last=5",
        "+callbacks.checkpoint.keep_best=0",
    )
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(result.stderr[-3000:])
    stalls = []
    for line in result.stderr.splitlines():  # every checkpoint, pruned ones included
        if "Checkpoint saved: " in line:
            path = Path(line.split("Checkpoint saved: ")[1].strip())
            if (path / "meta.json").exists():
                stalls.append(json.loads((path / "meta.json").read_text())["stall_s"])
    last = (run_dir / "checkpoints" / "last").resolve()
    size = sum(f.stat().st_size for f in last.rglob("*") if f.is_file())
    return stalls, wall, size / 1e9


def main() -> None:
    load = load_average()
    figures: dict[str, dict[str, list]] = {
        "sync": {"stall": [], "wall": []},
        "async": {"stall": [], "wall": []},
    }
    size_gb = 0.0
    with tempfile.TemporaryDirectory(prefix="fw-ckpt-bench-") as tmp:
        for i in range(REPEATS):
            for mode in ("sync", "async"):
                stalls, wall, size_gb = run(mode == "async", Path(tmp))
                figures[mode]["stall"] += stalls
                figures[mode]["wall"].append(wall)
            print(f"repeat {i + 1}/{REPEATS} done", flush=True)
    median = {m: statistics.median(f["stall"]) for m, f in figures.items() if f["stall"]}
    wall = {m: statistics.median(f["wall"]) for m, f in figures.items()}
    ratio = median["async"] / median["sync"]
    print(f"\ncheckpoint of {size_gb:.2f} GB on disk (last one, both ranks' files)")
    print("mode    stall per save (median, s)   saves   run wall time (median, s)")
    for mode in ("sync", "async"):
        n = len(figures[mode]["stall"])
        print(f"{mode:6}  {median[mode]:26.3f}   {n:5}   {wall[mode]:25.1f}")
    print(f"async / sync stall: {ratio:.3f} (target <= 0.10)")
    save_results(
        "checkpoint_stall",
        {
            "model": MODEL,
            "steps": STEPS,
            "every_n_steps": EVERY,
            "repeats": REPEATS,
            "checkpoint_gb": size_gb,
            "stall_s": {m: f["stall"] for m, f in figures.items()},
            "wall_s": {m: f["wall"] for m, f in figures.items()},
            "median_stall_s": median,
            "median_wall_s": wall,
            "async_over_sync_stall": ratio,
        },
        load,
    )


if __name__ == "__main__":
    main()
