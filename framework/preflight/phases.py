"""The memory of the phases around a job's steps, for `fw check`: a pretrained load, a resume
from a checkpoint (of this layout or another), and `fw export` of its checkpoints.

Every one reads by slices (framework/checkpoint): a rank ends a load holding its own share of
what it loads, which the step table already counts (a resume: params and optimizer; a pretrained
load: params), and holds at most one more piece while reading: one saved chunk of a sharded
checkpoint, one piece of a tensor read by position, one box of a pretrained tensor. `fw export`
keeps nothing: it holds one whole tensor while a piece of it is read (`export_phase`). These
figures come from the checkpoint's and the pretrained files' own metadata (nothing is read), so
a job whose node would run out of host memory on resume shows it before launch (`--host-mem`).
They count data only, not the code a process loads (Python, torch, the readers' imports).
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
    keeps: tuple[str, ...] = ()  # the step table's columns the phase fills (params, optimizer)


def phases(cfg: Any, model: Any) -> list[Phase]:
    """The phases this job goes through, as configured (`model`: the task built on meta)."""
    found = []
    ckpt = resume_checkpoint(cfg)
    if ckpt is not None:
        found.append(resume_phase(ckpt, bool(cfg.run.get("trust_checkpoint", False))))
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


def resume_phase(ckpt: Path, trust: bool = False) -> Phase:
    from framework.checkpoint import disk, formats, resume

    resume.check_safe(ckpt, "resume", trust)  # a refusal is an exit 2, as `fw train`'s
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
    return Phase("resume", transient, whole, what, ("params", "optimizer"))


def pretrained_phases(model: Any) -> list[Phase]:
    from framework.parallel.model import adapter_for

    found = []
    for source in adapter_for(model).pretrained_sources(model):
        with contextlib.closing(source):
            specs = source.model().values()
            largest = max((s.nbytes for s in specs), default=0)
            whole = sum(s.nbytes for s in specs)
            what = f"pretrained load from {getattr(source, 'directory', 'its files')}"
            found.append(Phase("pretrained load", largest, whole, what, ("params",)))
    return found


def export_phase(model: Any) -> Phase:
    """`fw export`: one tensor at a time, read whole (a new tensor) while each piece of it is
    read by position into it (one saved chunk, at most the tensor, at most the reader's PIECE):
    about twice the largest tensor. The hf format holds one output shard (--max-shard-size)."""
    import torch

    from framework.checkpoint.formats.torchfile import PIECE

    sizes = [
        t.numel() * t.element_size() for t in model.state_dict().values() if torch.is_tensor(t)
    ]
    largest = max(sizes, default=0)
    return Phase("export", largest + min(largest, PIECE), sum(sizes), "fw export (one process)")


def kept(phase: Phase, params: int, optimizer: int) -> int:
    """The part of a rank's state the phase fills: its params and optimizer (a resume), its
    params (a pretrained load), nothing (the exporting process)."""
    return (params if "params" in phase.keeps else 0) + (
        optimizer if "optimizer" in phase.keeps else 0
    )


def host_peak(phase: Phase, params: int, optimizer: int, on_cpu: bool) -> int:
    """A rank's host memory at the phase's peak: what it reads at once, plus what it fills of
    its own share when that lives on the host (a CPU job)."""
    return phase.transient + (kept(phase, params, optimizer) if on_cpu else 0)


def notes(found: list[Phase], params: int, optimizer: int) -> list[str]:
    """One line per phase: what a rank (the exporting process) holds beyond its own share;
    `params`, `optimizer`: the largest rank's share of each (the step table's columns)."""
    lines = []
    for phase in found:
        own = kept(phase, params, optimizer)
        unit, scale = byte_unit(max(phase.whole, phase.transient, own, 1))
        if phase.name == "export":
            lines.append(
                f"fw export of this job's checkpoints holds about {phase.transient / scale:.3f} "
                f"{unit} of data at once: its largest tensor whole and a piece being read into "
                f"it (--format hf: one output shard, at most --max-shard-size); the model is "
                f"{phase.whole / scale:.3f} {unit}; the code it loads comes on top."
            )
            continue
        share = "params and optimizer" if "optimizer" in phase.keeps else "params"
        lines.append(
            f"{phase.what[0].upper()}{phase.what[1:]}: each rank reads only its own part, "
            f"{own / scale:.3f} {unit} ({share}), and holds at most "
            f"{phase.transient / scale:.3f} {unit} more while reading "
            f"({phase.whole / scale:.3f} {unit} in all)."
        )
    return lines
