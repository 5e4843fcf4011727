"""The memory of the phases around a job's steps, for `fw check`: a pretrained load, a resume
from a checkpoint (of this layout or another), and `fw export` of its checkpoints.

Every one reads by slices (framework/checkpoint): a rank ends a load holding its own share of
the state, which the step table already counts (params, optimizer), and holds at most one more
piece while reading: one saved chunk of a sharded checkpoint, one piece of a tensor read by
position, one box of a pretrained tensor. These figures come from the checkpoint's and the
pretrained files' own metadata (nothing is read), so a job whose node would run out of host
memory on resume shows it before launch (`--host-mem`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from framework.preflight.report import byte_unit


@dataclass(frozen=True)
class Phase:
    """What one phase reads and holds beyond a rank's own share of the state."""

    name: str  # resume, pretrained load, export
    transient: int  # bytes held at once while reading, beyond what the rank keeps
    whole: int  # bytes of everything read, by all ranks together
    what: str  # what is read, for the message


def phases(cfg: Any, model: Any) -> list[Phase]:
    """The phases this job goes through, as configured (`model`: the task built on meta)."""
    found = []
    ckpt = resume_checkpoint(cfg)
    if ckpt is not None:
        found.append(resume_phase(ckpt))
    if model is not None:
        found += pretrained_phases(model)
        found.append(export_phase(model))
    return found


def resume_checkpoint(cfg: Any) -> Path | None:
    """The checkpoint the job would resume from (resume=PATH, or resume=auto in a run directory
    with checkpoints), without changing anything on disk."""
    from framework.checkpoint import disk

    mode = str(cfg.resume)
    if mode == "never":
        return None
    if mode == "auto":
        run_dir = Path(str(cfg.run.dir))
        if not (run_dir / "config.yaml").exists():
            return None
        return disk.newest_complete(run_dir / "checkpoints")
    with contextlib.suppress(Exception):
        return disk.resolve(Path(mode), "resume")
    return None


def resume_phase(ckpt: Path) -> Phase:
    from framework.checkpoint import disk, formats

    meta = disk.read_meta(ckpt)
    with contextlib.closing(formats.open_checkpoint(ckpt)) as source:
        whole = sum(s.nbytes for s in source.model().values())
        whole += sum(
            v.nbytes
            for o in source.optimizers()
            for entries in o.state.values()
            for v in entries.values()
            if hasattr(v, "nbytes")
        )
        transient = source.largest_read()
    what = (
        f"resume from {ckpt.name} ({meta.get('format', 'lightning')}, written by "
        f"{meta.get('world_size', 1)} process(es))"
    )
    return Phase("resume", transient, whole, what)


def pretrained_phases(model: Any) -> list[Phase]:
    from framework.parallel.model import adapter_for

    found = []
    for source in adapter_for(model).pretrained_sources(model):
        with contextlib.closing(source):
            specs = source.model().values()
            largest = max((s.nbytes for s in specs), default=0)
            whole = sum(s.nbytes for s in specs)
            what = f"pretrained load from {getattr(source, 'directory', 'its files')}"
            found.append(Phase("pretrained load", largest, whole, what))
    return found


def export_phase(model: Any) -> Phase:
    """`fw export`: one tensor at a time (the hf format: one safetensors shard at a time)."""
    import torch

    sizes = [
        t.numel() * t.element_size() for t in model.state_dict().values() if torch.is_tensor(t)
    ]
    return Phase("export", max(sizes, default=0), sum(sizes), "fw export (one process)")


def host_peak(phase: Phase, own: int, on_cpu: bool) -> int:
    """A rank's host memory at the phase's peak: what it reads at once, plus its own share of
    the state when that lives on the host (a CPU job)."""
    return phase.transient + (own if on_cpu and phase.name != "export" else 0)


def notes(found: list[Phase], own: int) -> list[str]:
    """One line per phase: what a rank (the exporting process) holds beyond its own share;
    `own`: the largest rank's own share of the state (params + optimizer)."""
    lines = []
    for phase in found:
        unit, scale = byte_unit(max(phase.whole, phase.transient, own, 1))
        if phase.name == "export":
            lines.append(
                f"fw export of this job's checkpoints holds at most {phase.transient / scale:.3f} "
                f"{unit} at once (one tensor; the model is {phase.whole / scale:.3f} {unit})."
            )
            continue
        lines.append(
            f"{phase.what[0].upper()}{phase.what[1:]}: each rank reads only its own part, "
            f"{own / scale:.3f} {unit} of state, and holds at most {phase.transient / scale:.3f} "
            f"{unit} more while reading ({phase.whole / scale:.3f} {unit} in all)."
        )
    return lines
