"""`callbacks.profile`: torch.profiler traces of a few training steps, one file per rank.

Every rank profiles the same optimizer steps, counted from the first step of this fit: `wait`
steps untouched, `warmup` steps profiled and thrown away (the profiler's own start-up), then
`active` steps recorded. Each rank writes RUN_DIR/profile/trace-rank{r}.json, a Chrome trace
(open it at https://ui.perfetto.dev or chrome://tracing); on CUDA also
RUN_DIR/profile/memory-rank{r}.pickle, the allocator's history over the active steps
(https://pytorch.org/memory_viz). `debug=profile` turns it on with a run just long enough.

A run with fewer steps left than wait + warmup + active is not refused (a callback's `validate`
sees its own config only, not `trainer.max_steps`): the profiler traces fewer steps and rank 0
warns, cutting `wait` first, then `warmup`, then `active` (at least one step is traced). A run
that stops inside the active steps (an error, a preemption) keeps the steps recorded so far.
"""

from __future__ import annotations

from dataclasses import dataclass

from framework.config.fields import doc


@dataclass
class Config:
    """torch.profiler over a few optimizer steps: a Chrome/Perfetto trace per rank."""

    kind: str = doc("profile", "Callback plugin.")
    wait: int = doc(2, "Optimizer steps run before profiling starts (the first are slow).", min=0)
    warmup: int = doc(
        2, "Steps profiled and then discarded, so the profiler's start-up is not traced.", min=0
    )
    active: int = doc(3, "Steps recorded in the trace.", min=1)
    record_shapes: bool = doc(True, "Record the input shapes of every operator.")
    profile_memory: bool = doc(
        False, "Record tensor allocations and frees in the trace (slower, larger traces)."
    )
    with_stack: bool = doc(False, "Record the Python stack of every operator (much larger traces).")


def validate(cfg: Config, world) -> None:
    """The bounds are declared on the fields; the run's length is checked in the workers."""


def build(cfg: Config, ctx):
    from framework.callbacks.profile.callback import Profile

    return Profile(cfg, ctx.run_dir / "profile")
