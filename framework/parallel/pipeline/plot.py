"""A picture of an executed pipeline schedule: one row per pipeline rank, one box per forward (F),
backward (B), input-gradient (I) or weight-gradient (W) pass, labelled with its microbatch and
hatched for a rank's later (virtual) stages; the white gaps are the bubble. Needs matplotlib (checked before launch when `strategy.trace=true`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

COLOURS = {"F": "#4c78a8", "B": "#f58518", "I": "#e45756", "W": "#54a24b"}
NAMES = {"F": "forward", "B": "backward", "I": "backward (input)", "W": "backward (weight)"}


def draw(info: dict[str, Any], path: Path, title: str | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    events = info["events"]
    p = len(events)
    end = max((e[4] for rank in events for e in rank), default=1.0)
    fig, ax = plt.subplots(figsize=(10, 0.6 * p + 1.4))
    for rank, rows in enumerate(events):
        for kind, stage, micro, t0, t1 in rows:
            ax.broken_barh(
                [(t0 * 1e3, (t1 - t0) * 1e3)],
                (rank - 0.4, 0.8),
                facecolor=COLOURS[kind],
                edgecolor="white",
                hatch="//" if stage >= p else None,  # a rank's later (virtual) stages
            )
            if (t1 - t0) / end > 0.012:
                ax.text((t0 + t1) / 2 * 1e3, rank, str(micro), ha="center", va="center", fontsize=7)
    ax.set_yticks(range(p), [f"rank {r}" for r in range(p)])
    ax.invert_yaxis()
    ax.set_xlabel("ms since the step began")
    used = sorted({e[0] for rank in events for e in rank}, key="FBIW".index)
    ax.legend(
        handles=[Patch(color=COLOURS[k], label=NAMES[k]) for k in used],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.35),
        ncol=len(used),
        fontsize=8,
    )
    ax.set_title(
        title
        or f"{info['schedule']}: pp={p}, {info['microbatches']} microbatches "
        f"(step {info['step']}; numbers are microbatches)",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
