"""Per-step overhead of `fw train` against a hand-written PyTorch loop on the digits task.

Both sides train the same MLP from the same seed, on the same samples in the same order, with the
same AdamW settings (read from conf/task/digits.yaml), in one process. A step is the wall time from
the start of one training batch to the start of the next (so it includes data loading and every
hook in between); the first warm-up steps are left out of the median. The final weights of the two
sides are compared, as a check that they did the same computation.

A third column, the same model trained by plain Lightning (benchmarks/plain_lightning.py, no
logger, no checkpoints), tells the framework's own cost apart from Lightning's. The runs alternate
fw, PyTorch, Lightning, fw, ...; the figures are medians of the per-run medians.

Two sizes of the task are measured side by side: the default one (a step of about 0.4 ms in plain
PyTorch) and a larger one (a wider net and a bigger batch, a step of about 23 ms), to show how the
ratio depends on the step's length when the per-step cost is fixed.

Every side runs with one intra-op thread (OMP_NUM_THREADS=1 for fw and Lightning, which both
respect it; torch.set_num_threads(1) for the loop in this process). fw alone would give its one
process every core, but on a shared machine two threads on two cores stall whenever another
process takes a core: in trial runs (hidden 16384, batch 256) the plain loop's step varied between
21 and 69 ms from run to run with two threads, and between 31 and 34 ms with one.

Each side also counts the minor page faults its process takes per step, after warm-up. At the large
size, glibc's malloc may give the big freed buffers back to the kernel and take fresh zeroed pages
on the next step, more or less often depending on each process's heap history, which costs wall
time unrelated to the training loop. To take that out of the comparison, run the script with, for
example, MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=4294967296 in the environment:
every side inherits it, and the results then go to benchmarks/results/overhead_malloc.json (which
records the variables) instead of overhead.json.

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
from dataclasses import asdict, dataclass
from itertools import pairwise
from pathlib import Path

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch import nn
from torch.utils.data import DataLoader

from benchmarks.common import FW, ROOT, load_average, save_results
from benchmarks.step_timer import minor_faults

REPEATS = 5
SEED = 0
TARGET_RATIO = 1.05
SIDES = ("fw", "plain", "lightning")
THREADS = 1  # intra-op threads on every side; see the module docstring
ENV = {**os.environ, "OMP_NUM_THREADS": str(THREADS)}


@dataclass(frozen=True)
class Size:
    """One size of the digits task, and how many steps to time it for."""

    hidden: int
    batch_size: int
    steps: int
    warmup: int


def sizes(task) -> dict[str, Size]:
    return {
        "default": Size(task.model.hidden, task.data.batch_size, steps=300, warmup=20),
        # 1437 training samples: 5 full batches of 256 per epoch.
        "large": Size(hidden=12288, batch_size=256, steps=200, warmup=10),
    }


def step_figures(times: dict, size: Size) -> tuple[float, float]:
    """(median start-to-start interval in ms, minor page faults per step), warm-up left out."""
    starts, faults = times["starts"][size.warmup :], times["faults"][size.warmup :]
    gaps = [b - a for a, b in pairwise(starts)]
    return 1000 * statistics.median(gaps), (faults[-1] - faults[0]) / len(gaps)


def run_fw(workdir: Path, size: Size) -> tuple[tuple[float, float], dict]:
    """Train through `fw train` with a StepTimer callback; (step_figures, final weights)."""
    times, weights = workdir / "times.json", workdir / "weights.pt"
    subprocess.run(
        [
            FW,
            "train",
            "task=digits",
            f"task.model.hidden={size.hidden}",
            f"task.data.batch_size={size.batch_size}",
            f"seed={SEED}",
            f"run.dir={workdir / 'run'}",
            f"trainer.max_steps={size.steps}",
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
        env=ENV,
        check=True,
        capture_output=True,
    )
    return step_figures(json.loads(times.read_text()), size), torch.load(weights)


def run_lightning(workdir: Path, size: Size) -> tuple[float, float]:
    """Train with benchmarks/plain_lightning.py; step_figures."""
    times = workdir / "times.json"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.plain_lightning",
            f"--hidden={size.hidden}",
            f"--batch-size={size.batch_size}",
            f"--max-steps={size.steps}",
            f"--step-times={times}",
            f"--root={workdir}",
            "--bare",
        ],
        cwd=ROOT,
        env=ENV,
        check=True,
        capture_output=True,
    )
    return step_figures(json.loads(times.read_text()), size)


def run_plain(task, size: Size) -> tuple[tuple[float, float], dict]:
    """The same training as a plain PyTorch loop; (step_figures, final weights)."""
    import lightning.pytorch as pl

    from recipes.digits.data import DigitsDataModule

    # The order fw follows: seed everything, build the net, then the data and the optimizer.
    pl.seed_everything(SEED, workers=True, verbose=False)
    net = nn.Sequential(
        nn.Linear(64, size.hidden),
        nn.ReLU(),
        nn.Dropout(task.model.dropout),
        nn.Linear(size.hidden, 10),
    )
    data = DigitsDataModule(batch_size=size.batch_size, val_fraction=task.data.val_fraction)
    data.setup("fit")
    dataset = data.train_set
    optimizer = torch.optim.AdamW(
        net.parameters(), lr=task.optimizer.lr, weight_decay=task.optimizer.weight_decay
    )
    net.train()
    starts: list[float] = []
    faults: list[int] = []
    epoch = 0
    while len(starts) < size.steps:
        # One seeded permutation per epoch (seed + epoch), as the framework's sampler draws it.
        order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(SEED + epoch))
        loader = DataLoader(
            dataset, batch_size=size.batch_size, sampler=order.tolist(), drop_last=True
        )
        for x, y in loader:
            starts.append(time.perf_counter())
            faults.append(minor_faults())
            loss = F.cross_entropy(net(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if len(starts) == size.steps:
                break
        epoch += 1
    return step_figures({"starts": starts, "faults": faults}, size), net.state_dict()


def max_difference(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def summarise(size: Size, runs: dict[str, list[tuple[float, float]]], diffs: list[float]) -> dict:
    ms = {side: [m for m, _ in r] for side, r in runs.items()}
    fw, plain, lightning = (statistics.median(ms[k]) for k in SIDES)
    return {
        **asdict(size),
        "fw_ms_per_step": fw,
        "plain_ms_per_step": plain,
        "lightning_ms_per_step": lightning,
        "fw_minus_plain_ms": fw - plain,
        "lightning_minus_plain_ms": lightning - plain,
        "ratio_fw_over_plain": fw / plain,
        "ratio_lightning_over_plain": lightning / plain,
        "ratio_fw_over_lightning": fw / lightning,
        "minor_page_faults_per_step": {
            side: statistics.median(f for _, f in r) for side, r in runs.items()
        },
        "max_abs_weight_difference": max(diffs),
        "ms_per_run": ms,
    }


def main() -> None:
    load_at_start = load_average()
    task = OmegaConf.load(ROOT / "conf" / "task" / "digits.yaml")
    torch.set_num_threads(THREADS)  # as many intra-op threads as fw and Lightning get (ENV)
    measured = sizes(task)
    runs = {name: {side: [] for side in SIDES} for name in measured}
    diffs: dict[str, list[float]] = {name: [] for name in measured}
    for repeat in range(REPEATS):
        for name, size in measured.items():
            with tempfile.TemporaryDirectory(prefix="fw-bench-") as tmp:
                figures, fw_weights = run_fw(Path(tmp), size)
                runs[name]["fw"].append(figures)
                figures, plain_weights = run_plain(task, size)
                runs[name]["plain"].append(figures)
                runs[name]["lightning"].append(run_lightning(Path(tmp), size))
            diffs[name].append(max_difference(fw_weights, plain_weights))
            print(
                f"run {repeat + 1}/{REPEATS} {name}: "
                + ", ".join(f"{k} {v[-1][0]:.3f} ms" for k, v in runs[name].items())
            )
    summary = {name: summarise(size, runs[name], diffs[name]) for name, size in measured.items()}
    print()
    header = "".join(
        f"{name + f' ({s.hidden}, {s.batch_size})':>23}" for name, s in measured.items()
    )
    print(f"{'ms/step (x plain)':26}{header}")
    for label, key in (
        ("plain PyTorch loop", "plain_ms_per_step"),
        ("plain Lightning", "lightning_ms_per_step"),
        ("fw train (1 process)", "fw_ms_per_step"),
    ):
        cells = "".join(
            f"{s[key]:>16.3f} ({s[key] / s['plain_ms_per_step']:.2f})" for s in summary.values()
        )
        print(f"{label:26}{cells}")
    for side in SIDES:
        cells = "".join(f"{s['minor_page_faults_per_step'][side]:>23.0f}" for s in summary.values())
        print(f"{f'page faults/step, {side}':26}{cells}")
    cells = "".join(f"{s['max_abs_weight_difference']:>23.2e}" for s in summary.values())
    print(f"{'max |weights fw - plain|':26}{cells}")
    print(f"target: fw / plain <= {TARGET_RATIO} (hidden, batch size in the header)")
    malloc = {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}
    results = {
        "task": "digits",
        "repeats": REPEATS,
        "threads": THREADS,
        "malloc_environment": malloc,
        "target_ratio": TARGET_RATIO,
        "sizes": summary,
    }
    save_results("overhead_malloc" if malloc else "overhead", results, load_at_start)


if __name__ == "__main__":
    main()
