"""`fw plot RUN_DIR [RUN_DIR ...] [--out FILE.png]`: a run's metrics.csv as one picture.

Panels, each over the step: the loss (`train/loss` solid, `val/loss` dashed), the throughput
(`perf/tokens_per_sec` where the runs have it, else `perf/samples_per_sec`, else
`perf/steps_per_sec`) and the peak memory (`perf/memory_peak_gib`). A panel no run has figures for
is left out. Several runs are drawn over each other, each named by its directory, to compare
strategies or settings. The picture goes to RUN_DIR/metrics.png for one run, to compare.png next
to the first run for several, or to `--out`.
"""

from __future__ import annotations

import csv
import importlib.util
import logging
import math
from dataclasses import dataclass
from pathlib import Path

from framework.errors import ConfigError

log = logging.getLogger("framework.plot")

USAGE = "Usage: fw plot RUN_DIR [RUN_DIR ...] [--out FILE.png]"
LOSSES = (("train/loss", "-", "train"), ("val/loss", "--", "val"))
THROUGHPUT = (
    ("perf/tokens_per_sec", "tokens/s"),
    ("perf/samples_per_sec", "samples/s"),
    ("perf/steps_per_sec", "steps/s"),
)
MEMORY = "perf/memory_peak_gib"


@dataclass(frozen=True)
class Run:
    """One run's figures: column -> (steps, values), only the cells that hold a number."""

    name: str
    series: dict[str, tuple[list[int], list[float]]]

    def has(self, column: str) -> bool:
        return bool(self.series.get(column, ((), ()))[0])


def plot_command(args: list[str]) -> int:
    """Draw the runs named in `args`; returns the exit code (errors are ConfigError)."""
    dirs, out = parse(args)
    if importlib.util.find_spec("matplotlib") is None:
        raise ConfigError(
            "command",
            "plot",
            "drawing needs matplotlib, which is not installed",
            hint="pip install matplotlib (the project's `bench` extra).",
        )
    runs = [read_run(d, name) for d, name in zip(dirs, run_names(dirs), strict=True)]
    if out is None:
        out = dirs[0] / "metrics.png" if len(dirs) == 1 else dirs[0].parent / "compare.png"
    panels = draw(runs, out)
    if not panels:
        raise ConfigError(
            "RUN_DIR",
            " ".join(str(d) for d in dirs),
            "metrics.csv has no train/loss, val/loss, perf/*_per_sec or perf/memory_peak_gib "
            "figures to draw",
        )
    log.info("Wrote %s (%s)", out, ", ".join(panels))
    return 0


def parse(args: list[str]) -> tuple[list[Path], Path | None]:
    """(run directories, output file or None) from the words after `fw plot`."""
    dirs: list[Path] = []
    out: Path | None = None
    words = iter(args)
    for word in words:
        if word == "--out" or word.startswith("--out="):
            value = word.partition("=")[2] or next(words, None)
            if not value or Path(value).suffix.lower() != ".png":
                raise ConfigError("--out", value, "expects a file name ending in .png", hint=USAGE)
            out = Path(value)
        elif word.startswith("-"):
            raise ConfigError("option", word, "unknown option", ["--out"], hint=USAGE)
        else:
            path = Path(word)
            if not path.is_dir():
                raise ConfigError(
                    "RUN_DIR", word, "not a directory", hint="Give the run.dir of a training run."
                )
            dirs.append(path.resolve())
    if not dirs:
        raise ConfigError("RUN_DIR", None, "no run directory given", hint=USAGE)
    return dirs, out


def run_names(dirs: list[Path]) -> list[str]:
    """Each run's directory name; parent/name where two runs share a name (multirun's 0, 1...)."""
    names = [d.name for d in dirs]
    return [f"{d.parent.name}/{d.name}" if names.count(d.name) > 1 else d.name for d in dirs]


def read_run(run_dir: Path, name: str) -> Run:
    """The numeric cells of RUN_DIR/metrics.csv by column; a ConfigError when there are none."""
    path = run_dir / "metrics.csv"
    if not path.is_file():
        raise ConfigError(
            "RUN_DIR",
            str(run_dir),
            "holds no metrics.csv",
            hint="It is written by logger=csv (on by default) in the run directory.",
        )
    with path.open(newline="") as fh:
        rows = list(csv.DictReader(fh))
    series: dict[str, tuple[list[int], list[float]]] = {}
    for row in rows:
        step = number(row.get("step"))
        if step is None:
            continue  # a row being written while we read (a live run)
        for column, cell in row.items():
            value = number(cell)
            if column and column != "step" and value is not None:
                steps, values = series.setdefault(column, ([], []))
                steps.append(int(step))
                values.append(value)
    if not series:
        raise ConfigError(
            "RUN_DIR",
            str(run_dir),
            "its metrics.csv has no rows with figures",
            hint="Plot a run that has logged at least one step (trainer.log_every_n_steps).",
        )
    return Run(name, series)


def number(cell: str | None) -> float | None:
    """The cell's finite value, or None for an empty or unreadable cell."""
    try:
        value = float(cell) if cell not in (None, "") else None
    except ValueError:
        return None
    return value if value is not None and math.isfinite(value) else None


def throughput_column(runs: list[Run]) -> tuple[str, str] | None:
    """The throughput figure to draw: the first in THROUGHPUT that every run with any has."""
    having = [r for r in runs if any(r.has(c) for c, _ in THROUGHPUT)]
    for column, unit in THROUGHPUT:
        if having and all(r.has(column) for r in having):
            return column, unit
    return next(((c, u) for c, u in THROUGHPUT if any(r.has(c) for r in runs)), None)


def draw(runs: list[Run], out: Path) -> list[str]:
    """Write the picture; returns the titles of the panels drawn (none: nothing written)."""
    from matplotlib.figure import Figure  # no pyplot: no global figure state, Agg for PNG

    panels: list[tuple[str, str, list[tuple[str, str, str]]]] = []  # title, y label, lines
    losses = [(c, style, label) for c, style, label in LOSSES if any(r.has(c) for r in runs)]
    if losses:
        panels.append(("loss", "loss", losses))
    speed = throughput_column(runs)
    if speed is not None:
        panels.append(("throughput", speed[1], [(speed[0], "-", "")]))
    if any(r.has(MEMORY) for r in runs):
        panels.append(("peak memory", "GiB per device", [(MEMORY, "-", "")]))
    if not panels:
        return []
    fig = Figure(figsize=(8, 2.8 * len(panels)), layout="constrained")
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (title, ylabel, lines) in zip(axes, panels, strict=True):
        for i, run in enumerate(runs):
            for column, style, label in lines:
                if run.has(column):
                    steps, values = run.series[column]
                    ax.plot(
                        steps,
                        values,
                        style,
                        color=f"C{i % 10}",
                        marker="o" if len(steps) <= 30 or label == "val" else None,
                        markersize=3,
                        label=f"{run.name} {label}".strip(),
                    )
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        if title != "loss":
            ax.set_ylim(bottom=0)  # speeds and memory compared from zero, not from the lowest run
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[-1].set_xlabel("step")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    return [p[0] for p in panels]
