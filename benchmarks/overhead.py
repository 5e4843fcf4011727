"""Per-step overhead of `fw train` against a hand-written PyTorch loop on the digits task.

Both sides train the same MLP from the same seed, on the same samples in the same order, with the
same AdamW settings (read from conf/task/digits.yaml), in one process. A step is the wall time from
the start of one training batch to the start of the next (so it includes data loading and every
hook in between); the first warm-up steps are left out of the median. The final weights of the two
sides are compared, as a check that they did the same computation. Each step is also timed on the
training thread's CPU clock (time.thread_time at every batch start, CpuStepTimer): on a machine
that other jobs share, a process waiting for a core loses wall time but not CPU time, so the CPU
figures stay comparable when the load is high (every side computes in its one training thread).

`fw train` runs with its default callbacks (conf/callbacks/default.yaml), with no logger and no
validation, as the plain Lightning script runs. At the default size it also runs once per default
callback with that callback alone turned off (`~callbacks.<name>`), and once with none
(`callbacks=none`): a callback's cost is the median over the repeats of (fw - fw without it),
each pair measured in the same repeat. (At the large size a fixed per-step cost is lost in the
step's noise: only fw with its defaults runs there.) A last fw run at the default size is profiled (cProfile
over the timed steps, the StepProfile callback below); the functions of framework/ with the most
cumulative time per step are printed: what per-step cost remains, and where.

A further column, the same model trained by plain Lightning (benchmarks/plain_lightning.py, no
logger, no checkpoints), tells the framework's own cost apart from Lightning's. The runs alternate
fw, fw without each callback, PyTorch, Lightning, fw, ...; the figures are medians of the per-run
medians.

Two sizes of the task are measured side by side: the default one (a step of about 0.4 ms in plain
PyTorch) and a larger one (a wider net and a bigger batch, a step of about 23 ms), to show how the
ratio depends on the step's length when the per-step cost is fixed.

Every side runs with one intra-op thread (OMP_NUM_THREADS=1 for fw and Lightning, which both
respect it; torch.set_num_threads(1) for the loop in this process). fw alone would give its one
process every core, but on a shared machine two threads on two cores stall whenever another
process takes a core: in trial runs (hidden 16384, batch 256) the plain loop's step varied between
21 and 69 ms from run to run with two threads, and between 31 and 34 ms with one.

Each side also counts the minor page faults its process takes per step, after warm-up, and its
resident size when training ends. At the large size, glibc's malloc may give the big freed
buffers back to the kernel and take fresh zeroed pages on the next step, more or less often
depending on each process's heap history (from 1,300 to 6,400 faults a step from run to run of
the same command, for the same 7 allocations of 1 MiB or more a step on both sides). fw fixes
glibc's thresholds in its training process (trainer.malloc=reuse, framework/allocator.py, the
default): so at the large size a further column, `fw malloc=system`, runs fw with glibc's own
thresholds, as the plain loop and plain Lightning run. To take the allocator out of every side,
run the script with, for example, MALLOC_MMAP_THRESHOLD_=4294967296
MALLOC_TRIM_THRESHOLD_=4294967296 in the environment: every side inherits it (fw then leaves
malloc alone), and the results go to benchmarks/results/overhead_malloc.json (which records the
variables) instead of overhead.json.

Run from the repository root: `python -m benchmarks.overhead` (or `make bench`).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import re
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from itertools import pairwise
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch import nn
from torch.utils.data import DataLoader

from benchmarks.common import FW, ROOT, load_average, run_checked, save_results
from benchmarks.step_timer import StepTimer, minor_faults

REPEATS = 5
SEED = 0
TARGET_RATIO = 1.00  # fw / plain Lightning, at both sizes
PLAIN_SIDES = ("plain", "lightning")
PROFILE_TOP = 15
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


def step_figures(times: dict, size: Size) -> tuple[float, float, float, float]:
    """(median start-to-start interval in ms, the same in the training thread's CPU time in ms,
    minor page faults per step, resident MiB when training ended), warm-up left out."""
    starts, faults = times["starts"][size.warmup :], times["faults"][size.warmup :]
    cpu = times["cpu"][size.warmup :]
    gaps = [b - a for a, b in pairwise(starts)]
    cpu_gaps = [b - a for a, b in pairwise(cpu)]
    return (
        1000 * statistics.median(gaps),
        1000 * statistics.median(cpu_gaps),
        (faults[-1] - faults[0]) / len(gaps),
        times["rss_mib"],
    )


def resident_mib() -> float:
    """This process's resident memory now, in MiB (Linux's /proc; 0 elsewhere)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except OSError:
        return 0.0
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


class CpuStepTimer(StepTimer):
    """StepTimer that also records the training thread's CPU time at each batch start: on a
    machine shared with other jobs, a process waiting for a core loses wall time, not CPU time."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.cpu: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.cpu.append(time.thread_time())
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)

    def on_train_end(self, trainer, pl_module) -> None:
        super().on_train_end(trainer, pl_module)
        name = self.path.name.replace("RANK", str(trainer.global_rank))
        times = json.loads(self.path.with_name(name).read_text())
        record = {**times, "cpu": self.cpu, "rss_mib": resident_mib()}
        self.path.with_name(name).write_text(json.dumps(record))


def default_callbacks() -> list[str]:
    """The names of the default callbacks (conf/callbacks/default.yaml's `defaults` entries)."""
    entries = OmegaConf.load(ROOT / "conf" / "callbacks" / "default.yaml").defaults
    return [e.partition("@")[2] for e in entries if isinstance(e, str) and "@" in e]


def fw_sides(callbacks: list[str]) -> dict[str, list[str]]:
    """fw's variants, by column name: the `fw train` overrides of each."""
    return {
        "fw": [],
        **{f"fw -{name}": [f"~callbacks.{name}"] for name in callbacks},
        "fw callbacks=none": ["callbacks=none"],
    }


# fw with glibc's own malloc thresholds, as the plain loop and plain Lightning run
GLIBC_SIDE = "fw malloc=system"
GLIBC_MALLOC = {GLIBC_SIDE: ["trainer.malloc=system"]}


def run_fw(
    workdir: Path, size: Size, overrides: list[str] = (), profile: Path | None = None
) -> tuple[tuple[float, float], dict]:
    """Train through `fw train` (default callbacks, then `overrides`) with a StepTimer callback,
    and a StepProfile writing to `profile` if given; (step_figures, final weights)."""
    workdir.mkdir(parents=True, exist_ok=True)
    times, weights = workdir / "times.json", workdir / "weights.pt"
    profiling = [
        "+callbacks.zprofile._target_=benchmarks.overhead.StepProfile",
        f"+callbacks.zprofile.path={profile}",
        f"+callbacks.zprofile.start={size.warmup}",
    ]
    command = [
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
        *overrides,
        "+callbacks.timer._target_=benchmarks.overhead.CpuStepTimer",
        f"+callbacks.timer.path={times}",
        f"+callbacks.timer.weights={weights}",
        *(profiling if profile else []),
    ]
    try:
        run_checked(command, "fw train", env=ENV)
    except RuntimeError as err:  # e.g. a port taken by another job on a shared machine
        print(f"{err}\nretrying once", flush=True)
        shutil.rmtree(workdir / "run", ignore_errors=True)  # no resume from the failed start
        run_checked(command, "fw train", env=ENV)
    return step_figures(json.loads(times.read_text()), size), torch.load(weights)


# benchmarks/plain_lightning.py with CpuStepTimer in place of its StepTimer
LIGHTNING = (
    "import sys, benchmarks.step_timer as timer, benchmarks.overhead as overhead;"
    "timer.StepTimer = overhead.CpuStepTimer;"
    "import benchmarks.plain_lightning as plain;"
    "sys.argv[0] = plain.__file__; plain.main()"
)


def run_lightning(
    workdir: Path, size: Size, code: str = LIGHTNING, env: dict = ENV
) -> tuple[float, float, float]:
    """Train with benchmarks/plain_lightning.py; step_figures."""
    workdir.mkdir(parents=True, exist_ok=True)
    times = workdir / "times.json"
    command = [
        sys.executable,
        "-c",
        code,
        f"--hidden={size.hidden}",
        f"--batch-size={size.batch_size}",
        f"--max-steps={size.steps}",
        f"--step-times={times}",
        f"--root={workdir}",
        "--bare",
    ]
    run_checked(command, "plain Lightning", env=env)
    return step_figures(json.loads(times.read_text()), size)


def run_plain(task, size: Size) -> tuple[tuple[float, float], dict]:
    """The same training as a plain PyTorch loop; (step_figures, final weights)."""
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
    cpu: list[float] = []
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
            cpu.append(time.thread_time())
            faults.append(minor_faults())
            loss = F.cross_entropy(net(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if len(starts) == size.steps:
                break
        epoch += 1
    times = {"starts": starts, "cpu": cpu, "faults": faults, "rss_mib": resident_mib()}
    return step_figures(times, size), net.state_dict()


def max_difference(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


class StepProfile(pl.Callback):
    """A callback (added to `fw train` from the command line) that runs cProfile from the start
    of batch `start` to the start of the last batch, and writes the statistics to `path`."""

    def __init__(self, path: str, start: int) -> None:
        self.path, self.start, self.batches = path, start, 0
        self.profiler = cProfile.Profile()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.batches == self.start:
            self.profiler.enable()
        elif self.batches == trainer.max_steps - 1:
            self.profiler.disable()
            self.profiler.dump_stats(self.path)
        self.batches += 1


def profile_table(path: Path, steps: int) -> list[dict]:
    """The functions of framework/ with the most cumulative time, per profiled step."""
    stats = pstats.Stats(str(path)).stats
    ours = str(ROOT / "framework") + os.sep
    rows = [
        {
            "function": f"{Path(file).relative_to(ROOT)}:{line}({name})",
            "calls_per_step": calls / steps,
            "cumulative_us_per_step": 1e6 * cumulative / steps,
            "own_us_per_step": 1e6 * own / steps,
        }
        for (file, line, name), (_, calls, own, cumulative, _) in stats.items()
        if file.startswith(ours)
    ]
    rows.sort(key=lambda r: -r["cumulative_us_per_step"])
    return rows[:PROFILE_TOP]


CLOCKS = ("wall", "cpu")  # step_figures' first two figures


def paired_cost(runs: dict, side: str, clock: int) -> float:
    """Median over the repeats of fw - `side` (ms per step on `clock`, an index into
    step_figures): what `side` leaves out costs."""
    return statistics.median(
        a[clock] - b[clock] for a, b in zip(runs["fw"], runs[side], strict=True)
    )


def summarise(size: Size, runs: dict[str, list[tuple]], diffs: list[float]) -> dict:
    """Per clock (wall, the training thread's CPU): medians, ratios and per-callback costs."""
    out: dict = {**asdict(size)}
    for i, clock in enumerate(CLOCKS):
        ms = {side: [r[i] for r in each] for side, each in runs.items()}
        median = {side: statistics.median(v) for side, v in ms.items()}
        fw, plain, lightning = median["fw"], median["plain"], median["lightning"]
        out[clock] = {
            "ms_per_step": median,
            "ratio_fw_over_plain": fw / plain,
            "ratio_lightning_over_plain": lightning / plain,
            "ratio_fw_over_lightning": fw / lightning,
            # the median of each repeat's ratio of neighbouring runs (see measure)
            "ratio_fw_over_lightning_paired": statistics.median(
                a / b for a, b in zip(ms["fw"], ms["lightning"], strict=True)
            ),
            "cost_ms_per_step": {
                side: paired_cost(runs, side, i) for side in runs if side.startswith("fw ")
            },
            "ms_per_run": ms,
        }
        if GLIBC_SIDE in ms:
            out[clock]["ratio_glibc_fw_over_lightning_paired"] = statistics.median(
                a / b for a, b in zip(ms[GLIBC_SIDE], ms["lightning"], strict=True)
            )
    out["minor_page_faults_per_step"] = {
        side: statistics.median(r[2] for r in each) for side, each in runs.items()
    }
    # the plain loop runs in this script's process: its resident size is not the loop's alone
    out["resident_mib_at_end"] = {
        side: statistics.median(r[3] for r in each)
        for side, each in runs.items()
        if side != "plain"
    }
    out["max_abs_weight_difference"] = max(diffs)
    return out


def measure(
    task, measured: dict[str, Size], variants: dict[str, dict[str, list[str]]], repeats: int
):
    """Every side of every size, `repeats` times in turn; (runs, weight differences). In each
    repeat plain Lightning runs right after fw with its defaults (the host's speed drifts over
    seconds: the pair's ratio is taken from neighbouring runs), then fw's other variants."""
    runs = {name: {side: [] for side in [*variants[name], *PLAIN_SIDES]} for name in measured}
    diffs: dict[str, list[float]] = {name: [] for name in measured}
    for repeat in range(repeats):
        for name, size in measured.items():
            with tempfile.TemporaryDirectory(prefix="fw-bench-") as tmp:
                weights = {}
                for side, overrides in variants[name].items():
                    workdir = Path(tmp) / re.sub(r"[^\w-]", "_", side)  # no "=" in a Hydra value
                    figures, weights[side] = run_fw(workdir, size, overrides)
                    runs[name][side].append(figures)
                    if side == "fw":
                        runs[name]["lightning"].append(run_lightning(Path(tmp) / "pl", size))
                figures, plain_weights = run_plain(task, size)
                runs[name]["plain"].append(figures)
            diffs[name].append(max_difference(weights["fw"], plain_weights))
            print(
                f"run {repeat + 1}/{repeats} {name} (load {load_average()}): "
                + ", ".join(f"{k} {v[-1][0]:.3f}/{v[-1][1]:.3f}" for k, v in runs[name].items())
                + " ms (wall/cpu)",
                flush=True,
            )
    return runs, diffs


def calls_per_step(path: Path, steps: int) -> float:
    """Python function calls per profiled step, every module's (the profile at `path`)."""
    return sum(calls for _, calls, _, _, _ in pstats.Stats(str(path)).stats.values()) / steps


class ProfiledStepTimer(CpuStepTimer):
    """plain_lightning.py's StepTimer with StepProfile's cProfile inside it (the Lightning
    script takes no extra callback): the statistics go to $BENCH_PROFILE."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.steps = StepProfile(os.environ["BENCH_PROFILE"], int(os.environ["BENCH_START"]))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.steps.on_train_batch_start(trainer, pl_module, batch, batch_idx)
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)


def profile(size: Size) -> tuple[list[dict], dict[str, float]]:
    """One more run of fw with the default callbacks and one of plain Lightning at `size`, both
    profiled over the same steps (each with its step timer); (profile_table of fw, Python calls
    per step of each). Calls are counted, not timed: the machine's load does not change them."""
    steps = size.steps - 1 - size.warmup
    with tempfile.TemporaryDirectory(prefix="fw-bench-") as tmp:
        path = Path(tmp) / "steps.prof"
        run_fw(Path(tmp), size, profile=path)
        top, calls = profile_table(path, steps), {"fw": calls_per_step(path, steps)}
        lightning = Path(tmp) / "lightning.prof"
        env = {**ENV, "BENCH_PROFILE": str(lightning), "BENCH_START": str(size.warmup)}
        code = LIGHTNING.replace("overhead.CpuStepTimer", "overhead.ProfiledStepTimer")
        run_lightning(Path(tmp) / "pl", size, code=code, env=env)
        calls["lightning"] = calls_per_step(lightning, steps)
    return top, calls


def print_tables(measured: dict[str, Size], summary: dict, top: list[dict]) -> None:
    header = "".join(
        f"{name + f' ({s.hidden}, {s.batch_size})':>23}" for name, s in measured.items()
    )
    sides = list(dict.fromkeys(side for s in summary.values() for side in s["wall"]["ms_per_step"]))
    for clock in CLOCKS:
        print(f"\n{clock + ' ms/step (x Lightning)':34}{header}")
        for side in ["plain", "lightning", *[x for x in sides if x not in PLAIN_SIDES]]:
            cells = ""
            for s in summary.values():
                value = s[clock]["ms_per_step"].get(side)
                ratio = value / s[clock]["ms_per_step"]["lightning"] if value else 0.0
                cells += f"{value:>16.3f} ({ratio:.3f})" if value else f"{'':>24}"
            print(f"{side:34}{cells}")
        for side in sides:
            if side.startswith("fw "):
                costs = [s[clock]["cost_ms_per_step"].get(side) for s in summary.values()]
                cells = "".join(f"{c:>+24.4f}" if c is not None else f"{'':>24}" for c in costs)
                print(f"{'cost: fw - (' + side + ')':34}{cells}")
    print()
    for figure, name in (
        ("minor_page_faults_per_step", "page faults/step"),
        ("resident_mib_at_end", "resident MiB at end"),
    ):
        for side in ["plain", "lightning", "fw", *GLIBC_MALLOC]:
            cells = [s[figure].get(side) for s in summary.values()]
            if any(c is not None for c in cells):
                text = "".join(f"{c:>24.0f}" if c is not None else f"{'':>24}" for c in cells)
                print(f"{f'{name}, {side}':34}{text}")
    cells = "".join(f"{s['max_abs_weight_difference']:>24.2e}" for s in summary.values())
    print(f"{'max |weights fw - plain|':34}{cells}")
    for clock in CLOCKS:
        cells = "".join(
            f"{s[clock]['ratio_fw_over_lightning_paired']:>24.3f}" for s in summary.values()
        )
        print(f"{f'fw / Lightning, paired, {clock}':34}{cells}")
    for clock in CLOCKS:
        ratios = [s[clock].get("ratio_glibc_fw_over_lightning_paired") for s in summary.values()]
        cells = "".join(f"{r:>24.3f}" if r is not None else f"{'':>24}" for r in ratios)
        print(f"{f'fw malloc=system / Lightning, {clock}':34}{cells}")
    print(f"target: fw / Lightning <= {TARGET_RATIO} at both sizes")
    if not top:
        return
    print("\nprofile of fw's steps (default size, cProfile): framework/ by cumulative time")
    print(f"{'us/step':>9} {'own':>7} {'calls':>6}  function")
    for row in top:
        print(
            f"{row['cumulative_us_per_step']:>9.1f} {row['own_us_per_step']:>7.1f} "
            f"{row['calls_per_step']:>6.2f}  {row['function']}"
        )


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=REPEATS, help="alternating repeats")
    parser.add_argument(
        "--baselines-only",
        action="store_true",
        help="fw with its defaults, plain PyTorch and plain Lightning only: no per-callback "
        "columns and no profile (more repeats in the same time, for fw / Lightning alone)",
    )
    return parser.parse_args()


def main() -> None:
    args = arguments()
    load_at_start = load_average()
    task = OmegaConf.load(ROOT / "conf" / "task" / "digits.yaml")
    torch.set_num_threads(THREADS)  # as many intra-op threads as fw and Lightning get (ENV)
    measured = sizes(task)
    every = fw_sides(default_callbacks())
    # a callback's fixed cost shows at the default size; at the large size it is within noise,
    # and the allocator's cost shows there
    variants = {
        "default": {"fw": every["fw"]} if args.baselines_only else every,
        "large": {"fw": every["fw"], **GLIBC_MALLOC},
    }
    runs, diffs = measure(task, measured, variants, args.repeats)
    summary = {name: summarise(size, runs[name], diffs[name]) for name, size in measured.items()}
    top, calls = profile(measured["default"])
    print()
    print_tables(measured, summary, [] if args.baselines_only else top)
    print(
        "\nPython calls per step (default size, cProfile over the same steps, counted): "
        + ", ".join(f"{side} {n:.0f}" for side, n in calls.items())
    )
    malloc = {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}
    results = {
        "task": "digits",
        "repeats": args.repeats,
        "threads": THREADS,
        "malloc_environment": malloc,
        "target_ratio_fw_over_lightning": TARGET_RATIO,
        "sizes": summary,
        "profile_default_size": top,
        "python_calls_per_step_default_size": calls,
    }
    name = "overhead_malloc" if malloc else "overhead"
    save_results(name + ("_baselines" if args.baselines_only else ""), results, load_at_start)


if __name__ == "__main__":
    main()
