"""What `fw sweep` leaves at the end: a table of the trials, the best trial as a ready `fw train`
command (both printed and written to `<sweep dir>/summary.txt`), and plots of the search
(`history.png`: the metric of each trial and the best so far; `importance.png`: how much each
searched key explains of the metric)."""

from __future__ import annotations

import io
import logging
import shlex
import warnings
from pathlib import Path
from typing import Any

from framework import files
from framework.sweep.space import override

log = logging.getLogger("framework.sweep")


def summary(study: Any, fixed: list[str], space: list[str], metric: str) -> str:
    """The trials as a table, then the best one as a command."""
    from optuna.trial import TrialState

    trials = sorted(study.get_trials(deepcopy=False), key=lambda t: t.number)
    rows = [("trial", "state", metric, *space)]
    for t in trials:
        value = "" if t.value is None else f"{t.value:.6g}"
        if t.state == TrialState.PRUNED and t.intermediate_values:
            value = f"{t.intermediate_values[max(t.intermediate_values)]:.6g}"  # when it stopped
        params = [_short(t.params.get(k, "")) for k in space]
        rows.append((str(t.number), t.state.name.lower(), value, *params))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    if complete:
        best = study.best_trial
        words = [*fixed, *(override(k, best.params[k]) for k in space)]
        lines += [
            "",
            f"Best: trial {best.number}, {metric}={best.value:.6g}:",
            "  fw train " + " ".join(shlex.quote(w) for w in words),
        ]
    else:
        lines += ["", "No trial has finished yet."]
    return "\n".join(lines) + "\n"


def _short(value: Any) -> str:
    if not isinstance(value, float):
        return str(value)
    text = f"{value:.4g}"
    return text if any(c in text for c in ".en") else f"{text}.0"  # 0.0 stays a float


def write(study: Any, sweep_dir: Path, text: str, metric: str) -> None:
    """summary.txt and the plots, in the sweep directory."""
    files.write_atomic(sweep_dir / "summary.txt", text)
    for name, drawn in plots(study, metric).items():
        path = sweep_dir / name
        png = io.BytesIO()
        drawn.savefig(png, format="png", dpi=100, bbox_inches="tight")
        files.write_atomic(path, png.getvalue())  # several processes of one search may draw
        log.info("Wrote %s", path)


def plots(study: Any, metric: str) -> dict[str, Any]:
    """The figures Optuna's matplotlib visualisation draws for this study (none it cannot)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from optuna.trial import TrialState
    from optuna.visualization import matplotlib as optuna_plots

    plt.close("all")
    figures = {}
    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "experimental" notices of the matplotlib backend
        if complete:
            axes = optuna_plots.plot_optimization_history(study, target_name=metric)
            figures["history.png"] = axes.figure
        if len(complete) >= 2:
            try:
                axes = optuna_plots.plot_param_importances(study, target_name=metric)
            except (ValueError, RuntimeError) as err:  # e.g. every trial drew the same values
                log.warning("No importance plot: %s", err)
            else:
                figures["importance.png"] = axes.figure
    return figures
