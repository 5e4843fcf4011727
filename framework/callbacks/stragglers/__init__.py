"""`callbacks.stragglers`: name the rank that makes the others wait.

Every rank times its own part of each training batch: the wall time it waited for its data, plus
the CPU time its training thread spent in the step. A rank blocked in a collective (gloo waits
without spinning) spends no CPU time, so the ranks that wait for a straggler do not look slow.
Every `every_n_steps` batches the ranks compare their mean times; the slowest rank and its ratio
to the median are logged (`perf/slowest_rank`, `perf/straggler_ratio`), a rank above
`threshold` x the median is named in the console, and a table of every rank ends the run.

On CUDA the step's compute runs on the GPU, so the host's wall clock from the batch start to the
backward is used instead. It is host time, not GPU time: kernels are queued asynchronously, so it
measures how long the host took to queue the forward plus any wait for the GPU (a full launch
queue, a value read back such as a logged metric), and follows a slow GPU only where the host
waits for it. Collectives inside the forward (FSDP and tensor-parallel all-gathers, metrics
logged with sync_dist) make the waiting ranks look slow too. On CUDA the ratio is a rough sign,
not a measurement. One process: nothing to compare.
"""

from __future__ import annotations

from dataclasses import dataclass

from framework.config.fields import doc


@dataclass
class Config:
    """Per-rank step time compared across ranks; the slowest rank named."""

    kind: str = doc("stragglers", "Callback plugin.")
    every_n_steps: int = doc(20, "Compare the ranks every this many training batches.", min=1)
    threshold: float = doc(
        1.5, "Name a rank whose time per batch exceeds this multiple of the median.", above=1.0
    )


def validate(cfg: Config, world) -> None:
    """The bounds are declared on the fields; nothing else to check before launch."""


def build(cfg: Config, ctx):
    from framework.callbacks.stragglers.callback import Stragglers

    return Stragglers(cfg)
