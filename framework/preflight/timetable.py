"""`fw plan` with a device: each layout's predicted step as a record (`--json`), the records in
the order asked for (`--sort`) with the recommended one marked, and the table printed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from framework.errors import ConfigError

if TYPE_CHECKING:
    from framework.preflight.report import CheckReport
    from framework.preflight.simulate import RankMemory


SORTS = ("time", "cost", "simplicity")
WITHIN = 0.05  # the recommendation: the simplest layout within 5% of the best time


@dataclass
class Option:
    """One layout that passed `fw check`."""

    order: int  # in the candidates' list: the simpler layouts first (see the docstring)
    name: str
    overrides: list[str]
    report: CheckReport
    comm_bytes: float
    prediction: Any = None  # its step on the device (framework.preflight.perf.Prediction)

    @property
    def worst(self) -> RankMemory:
        return self.report.worst


def predicted_rows(
    options: list[Option], base: list[str], gpus: int, tokens: float | None, price: float | None
) -> list[dict[str, Any]]:
    """One record per predicted option (the keys `fw plan --json` prints), simplest first."""
    found = []
    for o in options:
        p = o.prediction
        hours = tokens / p.tokens_per_s / 3600 if tokens else None
        found.append(
            {
                "layout": o.name,
                "overrides": [*base, *o.overrides],
                "order": o.order,
                "step_s": p.step_s,
                "tokens_per_s": p.tokens_per_s,
                "tokens_per_s_per_device": p.tokens_per_s / gpus,
                "mfu": p.mfu,
                "memory_gib": o.worst.total / 2**30,
                "hours": hours,
                "cost": hours * gpus * price if hours is not None and price is not None else None,
                "dominant": p.dominant,
                "terms_s": p.terms,
            }
        )
    return found


def ranked(rows: list[dict[str, Any]], sort: str) -> list[dict[str, Any]]:
    """The rows in `sort` order, the recommended one marked (`recommended`: True)."""
    if sort not in SORTS:
        raise ConfigError("--sort", sort, "is not a sort order", list(SORTS))
    if not rows:
        return rows
    # time is time per token: the layouts' steps take different numbers of tokens
    best = max(r["tokens_per_s"] for r in rows)
    near = [r for r in rows if r["tokens_per_s"] * (1 + WITHIN) >= best]
    chosen = min(near, key=lambda r: r["order"])
    for r in rows:
        r["recommended"] = r is chosen
    if sort == "simplicity":
        key = lambda r: r["order"]  # noqa: E731
    elif sort == "cost" and all(r["cost"] is not None for r in rows):
        key = lambda r: (r["cost"], r["order"])  # noqa: E731
    else:  # cost without a price orders as time: GPU-hours follow the step time
        key = lambda r: (-r["tokens_per_s"], r["order"])  # noqa: E731
    return sorted(rows, key=key)


def time_table(rows: list[dict[str, Any]], refused, device, gpus: int, world: str) -> str:
    """The predicted layouts as a table, the recommended one marked `*`."""
    lines = [
        f"Layouts of the job over {gpus} x {device.name} that pass fw check, predicted "
        f"(* recommended: the simplest within {WITHIN:.0%} of the best time):"
    ]
    head = ("", "layout", "step s", "tokens/s", "per GPU", "MFU", "GiB", "hours", "cost",
            "bound by", "command")  # fmt: skip
    table_rows = [head]
    for i, r in enumerate(rows):
        table_rows.append(
            (
                "*" if r["recommended"] else str(i + 1),
                r["layout"],
                f"{r['step_s']:.4g}",
                f"{r['tokens_per_s']:.4g}",
                f"{r['tokens_per_s_per_device']:.4g}",
                f"{100 * r['mfu']:.1f}%",
                f"{r['memory_gib']:.2f}",
                "-" if r["hours"] is None else f"{r['hours']:.4g}",
                "-" if r["cost"] is None else f"{r['cost']:,.0f}",
                r["dominant"],
                " ".join(["fw", "train", *r["overrides"], world]),
            )
        )
    return aligned(lines, table_rows, len(head), not rows, refused)


def aligned(
    lines: list[str], rows: list[tuple], columns: int, empty: bool, refused: list[tuple[str, str]]
) -> str:
    """`lines`, then `rows` in left-aligned columns (the first row is the head), "none fits"
    when `empty`, then the layouts left out and why: the end of both of fw plan's tables."""
    widths = [max(len(r[i]) for r in rows) for i in range(columns)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    if empty:
        lines.append("  none fits")
    if refused:
        lines.append("Left out:")
        lines += [f"  {name}: {why}" for name, why in refused]
    return "\n".join(lines)
