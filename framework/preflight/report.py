"""What `fw check` reports (`CheckReport`): its own module, so that the modules that read a
report (preflight/traffic.py, timetable.py) need not import the check that makes it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from framework.perf import gib
from framework.preflight.simulate import RankMemory


@dataclass
class CheckReport:
    """What `fw check` found: the layout, each representative rank's bytes, the device's."""

    layout: str
    world_size: int
    ranks: list[RankMemory]
    device_bytes: int | None = None
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    config: Any = None  # the composed, resolved config that was checked
    plugin: Any = None  # the strategy plugin module
    strategy: Any = None  # its typed config
    world: Any = None  # the process layout checked
    plan: Any = None  # the job's plan (framework/config/job_plan.py) that was checked
    sent: dict[int, dict[str, float]] = field(default_factory=dict)  # rank -> bytes per step

    @property
    def worst(self) -> RankMemory:
        return max(self.ranks, key=lambda r: r.total)

    @property
    def fits(self) -> bool | None:
        return None if self.device_bytes is None else self.worst.total <= self.device_bytes

    def table(self) -> str:
        head = ("rank", "role", "params", "grads", "optimizer", "activations", "opt step", "total")
        unit, scale = ("GiB", 2**30) if self.worst.total >= 2**30 else ("MiB", 2**20)
        sent = {r.rank: sum(self.sent.get(r.rank, {}).values()) for r in self.ranks}
        sent_unit, sent_scale = byte_unit(max(sent.values(), default=0))
        rows = [(*head, f"sent {sent_unit}/step", "")]
        for r in self.ranks:
            shares = [r.params, r.grads, r.optimizer, r.activations, r.optimizer_step, r.total]
            figures = (f"{n / scale:.3f}" for n in shares)
            rows.append((str(r.rank), r.role, *figures, f"{sent[r.rank] / sent_scale:.3f}", r.note))
        widths = [max(len(row[i]) for row in rows) for i in range(len(head) + 2)]
        lines = [
            "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows
        ]
        lines.insert(1, "-" * len(lines[0]))
        verdict = [f"{self.layout}, {self.world_size} processes; {unit} per rank."]
        if self.device_bytes is not None:
            worst = self.worst
            word = "fits in" if self.fits else "does NOT fit in"
            verdict.append(
                f"Worst rank {worst.rank}: {gib(worst.total):.2f} GiB, {word} the device's "
                f"{gib(self.device_bytes):.1f} GiB ({100 * worst.total / self.device_bytes:.0f}%)."
            )
        return "\n".join([*verdict, *lines, *self.notes, f"Checked in {self.seconds:.1f} s."])


def byte_unit(n: float) -> tuple[str, int]:
    """The unit a byte count reads best in: GiB, MiB or KiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if n >= scale:
            return unit, scale
    return "KiB", 2**10
