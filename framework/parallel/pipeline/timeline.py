"""What the pipeline's stages did and when: busy time per stage, the bubble, in-flight
microbatches, and a picture of one executed schedule."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
import torch.distributed as dist


class Timeline:
    """When each stage ran forward (F), backward (B; I and W when split) of which microbatch."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int, int, float, float]] = []
        self.start = self.stop = 0.0
        self.inflight = self.peak = 0

    def watch(self, stage) -> None:
        for kind, attr in (
            ("F", "forward_one_chunk"),
            ("B", "backward_one_chunk"),
            ("W", "backward_weight_one_chunk"),
        ):
            setattr(stage, attr, self._timed(stage, kind, getattr(stage, attr)))

    def _timed(self, stage, kind, run):
        def timed(chunk, *args, **kwargs):
            t0 = time.perf_counter()
            out = run(chunk, *args, **kwargs)
            t1 = time.perf_counter()
            label = kind
            if kind == "B" and not kwargs.get("full_backward", args[1] if len(args) > 1 else True):
                label = "I"
            self.events.append((label, stage.stage_index, int(chunk), t0, t1))
            self.inflight += 1 if label == "F" else -1 if label in ("B", "I") else 0
            self.peak = max(self.peak, self.inflight)
            return out

        return timed

    def begin(self) -> None:
        self.events, self.inflight, self.peak = [], 0, 0
        self.start = time.perf_counter()

    def end(self) -> None:
        self.stop = time.perf_counter()

    def wall(self) -> float:
        return self.stop - self.start

    def busy(self) -> dict[int, float]:
        out: dict[int, float] = {}
        for _, stage, _, t0, t1 in self.events:
            out[stage] = out.get(stage, 0.0) + t1 - t0
        return out

    def relative(self) -> list[tuple[str, int, int, float, float]]:
        return [(k, s, m, t0 - self.start, t1 - self.start) for k, s, m, t0, t1 in self.events]


def gathered_table(timeline: Timeline, n_stages: int, pp: int, group, device) -> torch.Tensor:
    """Every pipeline rank's row (busy seconds per stage, peak in-flight microbatches, wall
    seconds), gathered over `group` on `device`, the group's device (NCCL takes no CPU tensor)."""
    row = torch.zeros(n_stages + 2, dtype=torch.float64)
    for s, busy in timeline.busy().items():
        row[s] = busy
    row[-2] = timeline.peak
    row[-1] = timeline.wall()
    row = row.to(device)
    rows = [torch.zeros_like(row) for _ in range(pp)]
    dist.all_gather(rows, row, group=group)
    return torch.stack(rows).cpu()


def gathered_metrics(timeline: Timeline, n_stages: int, pp: int, group, device) -> dict[str, float]:
    """The step's pipeline metrics, the same on every rank: bubble fraction, busy seconds per
    stage, peak in-flight microbatches per pipeline rank (one all-gather over `group`)."""
    table = gathered_table(timeline, n_stages, pp, group, device)
    busy = table[:, :n_stages].sum(0)
    wall = float(table[:, -1].max())
    metrics = {"pipeline/bubble": 1.0 - float(busy.sum()) / (pp * wall) if wall > 0 else 0.0}
    metrics.update({f"pipeline/busy_s_stage{s}": float(busy[s]) for s in range(n_stages)})
    metrics.update({f"pipeline/peak_microbatches_rank{r}": float(table[r, -2]) for r in range(pp)})
    return metrics


def save_trace(timeline: Timeline, info: dict, run_dir: Path, group, pp: int, write: bool) -> None:
    """Gather every pipeline rank's events; on the writing rank, save them as JSON and draw
    them (`pipeline_schedule.json`, `pipeline_schedule.png` in the run directory)."""
    events = [None] * pp
    dist.all_gather_object(events, timeline.relative(), group=group)
    if not write:
        return
    from framework.parallel.pipeline.plot import draw

    info = {**info, "events": events}
    (run_dir / "pipeline_schedule.json").write_text(json.dumps(info))
    draw(info, run_dir / "pipeline_schedule.png")
