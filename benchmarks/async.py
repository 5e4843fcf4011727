"""ddp against diloco (H = 4, 16) and hogwild over a slow link: step time, bytes per step, and the
validation loss reached after the same training wall time.

Every side trains the gpt recipe at gpt_tiny's size (2 layers of width 64, sequences of 64 bytes,
8 per process and step; Ψ ≈ 120 k parameters, 482 kB of fp32 gradients) with a constant lr on 2
CPU processes (gloo) for `--budget-s` seconds of training, validating every `--val-every` steps
(a multiple of every H, so diloco is validated on the model the processes agree on). Two
callbacks are added from the command line: `SlowLink` (benchmarks/slow_link.py) makes each
synchronisation sleep `latency + bytes / bandwidth` before its collective, as a link of
`--latency-ms` and `--mbit` Mbit/s would (the kernel here has no netem to shape the loopback
with), and `ValClock` (benchmarks/val_clock.py) records (step, training seconds, validation loss)
at every validation, validation time left out, and stops training at the first validation after
the budget.

Per side: step time (training seconds per step between the first and the last validation: whole
rounds), bytes each process sends per step (what the link carried, over the steps), the link's
sleep per step, the validation loss at exactly `--budget-s` seconds (linear interpolation between
validations), at the step ddp reached, and the seconds it took to first reach ddp's loss at the
budget. Sides run one at a time and alternate over `--repeats`; a figure is the median over
repeats. The curves are drawn into docs/img/async_loss_vs_time.png.

Run from the repository root: `python -m benchmarks.async` (about 9 minutes; part of `make bench`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import ROOT, load_average, run_checked, save_results, train_command

MODEL = [
    "experiment=gpt_tiny",
    "task.model.sample_length=0",
    "task.data.max_bytes=3000000",  # ~2900 steps an epoch: no side repeats its data
    "task.scheduler.name=constant",  # the lr at a step does not depend on how long a side runs
    "trainer.limit_val_batches=16",
    "trainer.check_val_every_n_epoch=null",  # count validation steps globally, across epochs
    "trainer.log_every_n_steps=32",
]
PROCESSES = 2
MAX_STEPS = 100_000  # the time budget stops every side first
IMAGES = ROOT / "docs" / "img"
YLIM_TOP = 4.0  # the plot's loss axis stops here; a point above is drawn as a line leaving it


@dataclass(frozen=True)
class Side:
    """One way of training: a label, its strategy and that strategy's overrides."""

    name: str
    strategy: str
    overrides: tuple[str, ...] = ()

    def available(self) -> bool:
        return (ROOT / "conf" / "strategy" / f"{self.strategy}.yaml").exists()


SIDES = (
    Side("ddp", "ddp"),
    Side("diloco H=4", "diloco", ("strategy.sync_every=4",)),
    Side("diloco H=16", "diloco", ("strategy.sync_every=16",)),
    Side("hogwild", "hogwild"),
)


def train(side: Side, args: argparse.Namespace) -> dict:
    """One run of `side`: its validation points and rank 0's link record."""
    with tempfile.TemporaryDirectory(prefix="fw-bench-async-") as tmp:
        command = train_command(f"{tmp}/run", MAX_STEPS, PROCESSES, *MODEL)
        command = [c for c in command if c != "trainer.limit_val_batches=0"] + [
            f"strategy={side.strategy}",
            *side.overrides,
            f"trainer.val_check_interval={args.val_every}",
            "+callbacks.link._target_=benchmarks.slow_link.SlowLink",
            f"+callbacks.link.path={tmp}/link-RANK.json",
            f"+callbacks.link.latency_ms={args.latency_ms}",
            f"+callbacks.link.mbit={args.mbit}",
            f"+callbacks.link.scope={args.link_scope}",
            "+callbacks.clock._target_=benchmarks.val_clock.ValClock",
            f"+callbacks.clock.path={tmp}/clock.json",
            f"+callbacks.clock.budget_s={args.budget_s}",
        ]
        run_checked(command, side.name)
        return {
            "points": json.loads(Path(tmp, "clock.json").read_text()),
            "link": json.loads(Path(tmp, "link-0.json").read_text()),
        }


def at(points: list[dict], key: str, x: float, value: str = "val_loss") -> float | None:
    """`value` where `key` (train_s or step) is `x`, linear between validations; None outside."""
    for a, b in zip(points, points[1:], strict=False):
        if a[key] <= x <= b[key]:
            return a[value] + (x - a[key]) / (b[key] - a[key]) * (b[value] - a[value])
    return None


def first_reaches(points: list[dict], loss: float) -> float | None:
    """The training seconds at which the validation loss first falls to `loss`."""
    for a, b in zip(points, points[1:], strict=False):
        if b["val_loss"] <= loss < a["val_loss"]:
            fraction = (a["val_loss"] - loss) / (a["val_loss"] - b["val_loss"])
            return a["train_s"] + fraction * (b["train_s"] - a["train_s"])
    return None


def figures(run: dict, budget_s: float, ddp_step: float, ddp_loss: float) -> dict:
    points, link = run["points"], run["link"]
    first, last = points[0], points[-1]
    reached = first_reaches(points, ddp_loss)
    return {
        "step_s": (last["train_s"] - first["train_s"]) / (last["step"] - first["step"]),
        "bytes_per_step": link["bytes"] / link["steps"],
        "link_s_per_step": link["delay_s"] / link["steps"],
        "steps_in_budget": at(points, "train_s", budget_s, "step"),
        "loss_at_budget": at(points, "train_s", budget_s),
        "loss_at_ddp_step": at(points, "step", ddp_step),
        "s_to_ddp_loss": reached,
    }


def summarise(runs: dict[str, list[dict]], budget_s: float) -> list[dict]:
    """One row per side: the median over its repeats of each figure, and ratios to ddp's."""
    rows = []
    ddp_runs = runs["ddp"]
    for name, side_runs in runs.items():
        per_run = []
        for ddp, run in zip(ddp_runs, side_runs, strict=True):
            ddp_step = at(ddp["points"], "train_s", budget_s, "step")
            ddp_loss = at(ddp["points"], "train_s", budget_s)
            per_run.append(figures(run, budget_s, ddp_step, ddp_loss))
        row = {"side": name}
        for key in per_run[0]:
            values = [r[key] for r in per_run if r[key] is not None]
            row[key] = statistics.median(values) if values else None
        rows.append(row)
    ddp = rows[0]
    for row in rows:
        row["step_vs_ddp"] = row["step_s"] / ddp["step_s"]
        row["bytes_vs_ddp"] = row["bytes_per_step"] / ddp["bytes_per_step"]
    return rows


def plot(runs: dict[str, list[dict]], args: argparse.Namespace, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_time, by_step) = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    for index, (name, side_runs) in enumerate(runs.items()):
        color = f"C{index}"
        for repeat, run in enumerate(side_runs):
            points = run["points"]
            style = {"color": color, "linestyle": "-" if repeat == 0 else "--", "linewidth": 1.2}
            losses = [p["val_loss"] for p in points]
            label = name if repeat == 0 else None
            by_time.plot([p["train_s"] for p in points], losses, label=label, **style)
            by_step.plot([p["step"] for p in points], losses, **style)
    # diloco's first validation can lie far above the rest (the outer momentum's first steps)
    by_time.set_ylim(top=min(by_time.get_ylim()[1], YLIM_TOP))
    by_time.axvline(args.budget_s, color="grey", linewidth=0.8, linestyle=":")
    by_time.set_xlabel("training wall time (s), validation left out")
    by_step.set_xlabel("optimizer step")
    by_time.set_ylabel("validation loss")
    by_time.set_title(f"loss vs time, link {args.latency_ms:g} ms + {args.mbit:g} Mbit/s")
    by_step.set_title("loss vs step (what the rounds cost per step)")
    by_time.legend(title="dashed: 2nd run" if args.repeats > 1 else None)
    for ax in (by_time, by_step):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--latency-ms", type=float, default=50.0, help="per message (default 50)")
    parser.add_argument("--mbit", type=float, default=100.0, help="bandwidth (default 100)")
    parser.add_argument(
        "--link-scope",
        choices=("sync", "all"),
        default="sync",
        help="sync: only the model's synchronisation crosses the link; all: every collective "
        "of a training step (the recipe's per-step loss all-reduce too)",
    )
    parser.add_argument("--budget-s", type=float, default=45.0, help="training seconds a side")
    parser.add_argument("--val-every", type=int, default=32, help="steps between validations")
    parser.add_argument("--repeats", type=int, default=2, help="runs per side, alternating")
    parser.add_argument(
        "--name",
        default="async",
        help="results go to benchmarks/results/NAME.json, the plot to docs/img/NAME_loss_vs_time.png",
    )
    return parser.parse_args()


def main() -> None:
    args = parse()
    load_at_start = load_average()
    sides = [s for s in SIDES if s.available()]
    for side in SIDES:
        if not side.available():
            print(f"{side.name}: skipped, conf/strategy/{side.strategy}.yaml does not exist")
    runs: dict[str, list[dict]] = {s.name: [] for s in sides}
    for repeat in range(args.repeats):
        order = sides if repeat % 2 == 0 else sides[::-1]
        for side in order:
            runs[side.name].append(train(side, args))
            last = runs[side.name][-1]["points"][-1]
            print(
                f"{side.name}: step {last['step']} at {last['train_s']:.1f} s, val loss {last['val_loss']:.3f}"
            )
    rows = summarise(runs, args.budget_s)
    print_table(rows, args)
    plot(runs, args, IMAGES / f"{args.name}_loss_vs_time.png")
    results = {
        "processes": PROCESSES,
        "model": MODEL,
        "link": {"latency_ms": args.latency_ms, "mbit": args.mbit, "scope": args.link_scope},
        "budget_s": args.budget_s,
        "val_every": args.val_every,
        "repeats": args.repeats,
        "rows": rows,
        "runs": runs,
    }
    save_results(args.name, results, load_at_start)


def print_table(rows: list[dict], args: argparse.Namespace) -> None:
    def number(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    print(
        f"{PROCESSES} CPU processes, link {args.latency_ms:g} ms + {args.mbit:g} Mbit/s "
        f"(scope {args.link_scope}), {args.budget_s:g} s of training a side, "
        f"median of {args.repeats}"
    )
    print(
        "side          step (ms)  vs ddp  link/step (ms)  kB/step  vs ddp  steps  "
        f"loss@{args.budget_s:g}s  loss@ddp's step  s to ddp's loss"
    )
    for r in rows:
        print(
            f"{r['side']:<13} {r['step_s'] * 1e3:>9.1f} {r['step_vs_ddp']:>7.3f} "
            f"{r['link_s_per_step'] * 1e3:>15.1f} {r['bytes_per_step'] / 1e3:>8.1f} "
            f"{r['bytes_vs_ddp']:>7.4f} {number(r['steps_in_budget'], '>6.0f')} "
            f"{number(r['loss_at_budget'], '>10.3f')} {number(r['loss_at_ddp_step'], '>16.3f')} "
            f"{number(r['s_to_ddp_loss'], '>16.1f')}"
        )


if __name__ == "__main__":
    main()
