"""Per-step overhead of `fw train` against a hand-written PyTorch loop on the digits task.

Both sides train the same MLP from the same seed, on the same samples in the same order, with the
same AdamW settings (read from conf/task/digits.yaml), in one process. A step is the wall time from
the start of one training batch to the start of the next (so it includes data loading and every
hook in between); the first WARMUP steps are left out of the median. The final weights of the two
sides are compared, as a check that they did the same computation.

A third column, the same model trained by plain Lightning (benchmarks/plain_lightning.py, no
logger, no checkpoints), tells the framework's own cost apart from Lightning's. The runs alternate
fw, PyTorch, Lightning, fw, ...; the figures are medians of the per-run medians.

Run from the repository root: `python -m benchmarks.overhead` (or `make bench`).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from itertools import pairwise
from pathlib import Path

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch import nn
from torch.utils.data import DataLoader

from benchmarks.common import FW, ROOT, load_average, save_results

STEPS = 300
WARMUP = 20
REPEATS = 3
SEED = 0
TARGET_RATIO = 1.05


def median_step_ms(starts: list[float]) -> float:
    """Median start-to-start interval in milliseconds, warm-up steps excluded."""
    gaps = [b - a for a, b in pairwise(starts[WARMUP:])]
    return 1000 * statistics.median(gaps)


def run_fw(workdir: Path) -> tuple[float, dict]:
    """Train through `fw train` with a StepTimer callback; (median ms/step, final weights)."""
    times, weights = workdir / "times.json", workdir / "weights.pt"
    subprocess.run(
        [
            FW,
            "train",
            "task=digits",
            f"seed={SEED}",
            f"run.dir={workdir / 'run'}",
            f"trainer.max_steps={STEPS}",
            "trainer.accelerator=cpu",
            "trainer.limit_val_batches=0",  # the plain loop does not validate either
            "trainer.enable_progress_bar=false",
            "trainer.enable_model_summary=false",
            "logger=[]",
            "callbacks=none",
            "+callbacks.timer._target_=benchmarks.step_timer.StepTimer",
            f"+callbacks.timer.path={times}",
            f"+callbacks.timer.weights={weights}",
        ],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    starts = json.loads(times.read_text())["starts"]
    return median_step_ms(starts), torch.load(weights)


def run_lightning(workdir: Path) -> float:
    """Train with benchmarks/plain_lightning.py; median ms/step."""
    times = workdir / "times.json"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.plain_lightning",
            f"--max-steps={STEPS}",
            f"--step-times={times}",
            f"--root={workdir}",
            "--bare",
        ],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    return median_step_ms(json.loads(times.read_text())["starts"])


def run_plain(task) -> tuple[float, dict]:
    """The same training as a plain PyTorch loop; (median ms/step, final weights)."""
    import lightning.pytorch as pl

    from recipes.digits.data import DigitsDataModule

    # The order fw follows: seed everything, build the net, then the data and the optimizer.
    pl.seed_everything(SEED, workers=True, verbose=False)
    hidden, dropout = task.model.hidden, task.model.dropout
    net = nn.Sequential(
        nn.Linear(64, hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, 10)
    )
    data = DigitsDataModule(batch_size=task.data.batch_size, val_fraction=task.data.val_fraction)
    data.setup("fit")
    dataset = data.train_set
    optimizer = torch.optim.AdamW(
        net.parameters(), lr=task.optimizer.lr, weight_decay=task.optimizer.weight_decay
    )
    net.train()
    starts: list[float] = []
    epoch = 0
    while len(starts) < STEPS:
        # One seeded permutation per epoch (seed + epoch), as the framework's sampler draws it.
        order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(SEED + epoch))
        loader = DataLoader(
            dataset, batch_size=task.data.batch_size, sampler=order.tolist(), drop_last=True
        )
        for x, y in loader:
            starts.append(time.perf_counter())
            loss = F.cross_entropy(net(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if len(starts) == STEPS:
                break
        epoch += 1
    return median_step_ms(starts), net.state_dict()


def max_difference(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def main() -> None:
    load_at_start = load_average()
    task = OmegaConf.load(ROOT / "conf" / "task" / "digits.yaml")
    # fw gives its one process every core (framework.worker.limit_threads); so does the baseline.
    torch.set_num_threads(os.cpu_count() or 1)
    ms: dict[str, list[float]] = {"fw": [], "plain": [], "lightning": []}
    diffs = []
    for repeat in range(REPEATS):
        with tempfile.TemporaryDirectory(prefix="fw-bench-") as tmp:
            step_ms, fw_weights = run_fw(Path(tmp))
            ms["fw"].append(step_ms)
            step_ms, plain_weights = run_plain(task)
            ms["plain"].append(step_ms)
            ms["lightning"].append(run_lightning(Path(tmp)))
        diffs.append(max_difference(fw_weights, plain_weights))
        print(
            f"run {repeat + 1}/{REPEATS}: " + ", ".join(f"{k} {v[-1]:.3f}" for k, v in ms.items())
        )
    fw, plain, lightning = (statistics.median(ms[k]) for k in ("fw", "plain", "lightning"))
    results = {
        "task": "digits",
        "steps": STEPS,
        "warmup_steps_excluded": WARMUP,
        "repeats": REPEATS,
        "batch_size": task.data.batch_size,
        "fw_ms_per_step": fw,
        "plain_ms_per_step": plain,
        "lightning_ms_per_step": lightning,
        "ratio_fw_over_plain": fw / plain,
        "ratio_lightning_over_plain": lightning / plain,
        "ratio_fw_over_lightning": fw / lightning,
        "target_ratio": TARGET_RATIO,
        "max_abs_weight_difference": max(diffs),
        "ms_per_run": ms,
    }
    print()
    print(f"{'':26}{'ms/step':>9}{'/ plain':>9}")
    for name, value in (
        ("plain PyTorch loop", plain),
        ("plain Lightning", lightning),
        ("fw train (1 process)", fw),
    ):
        print(f"{name:26}{value:>9.3f}{value / plain:>9.2f}")
    print(f"target: fw / plain <= {TARGET_RATIO}")
    print(f"max |weight difference| fw vs plain: {max(diffs):.2e}")
    save_results("overhead", results, load_at_start)


if __name__ == "__main__":
    main()
