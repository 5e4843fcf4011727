"""`callbacks.throughput`: speed, FLOP/s, MFU, memory and data wait of training, as metrics.

Every `window` optimizer steps rank 0 works out these figures, averaged over the window
(validation excluded), and logs them at the next step Lightning writes to the loggers
(`trainer.log_every_n_steps`; Lightning writes only the newest value logged before then):

| metric | meaning |
|---|---|
| perf/steps_per_sec | optimizer steps per second |
| perf/samples_per_sec | samples per second over the whole job (a batch counted once per data-parallel rank: tensor- and pipeline-parallel ranks share theirs) |
| perf/tokens_per_sec | tokens per second over the job, for batches whose input is a 2-D integer tensor (token ids) |
| perf/tflops_per_device | model FLOPs this rank computes per second, in 10^12 |
| perf/mfu | perf/tflops_per_device / the device's peak (trainer.peak_tflops, else the known GPU's dense bf16 peak); not logged when neither is known (the CPU) |
| perf/memory_peak_gib | CUDA: the most memory allocated so far; CPU: the process's peak resident set |
| perf/memory_reserved_gib | CUDA: the most memory the caching allocator reserved so far |
| perf/data_wait_ms | the time from the end of one batch to the start of the next, in which the loader hands over the next batch; a warning names the loader when it exceeds `warn_data_wait` of the step time and matters in seconds (at least 5 ms a batch, and 1 s in all after the first window) |

FLOPs are counted, not estimated: the first training batch runs under a dispatch mode that adds
up, with torch's FlopCounterMode formulas, the FLOPs of every matrix multiplication and attention
kernel this rank executes in forward and backward (elementwise work is not counted;
`framework.perf.flop_counter`). Under activation
checkpointing the recomputed forward is counted too, so perf/mfu is then the hardware FLOPs
utilisation. With `trainer.compile=true` the count is taken the same way, on the first (eager,
tracing) batch. The count is logged once as perf/flops_per_batch.
"""

from __future__ import annotations

from dataclasses import dataclass

from framework.config.fields import doc


@dataclass
class Config:
    """Log speed, FLOP/s, MFU, peak memory and data wait, averaged over a window of steps."""

    kind: str = doc("throughput", "Callback plugin.")
    window: int = doc(10, "Average over this many optimizer steps.", min=1)
    count_flops: bool = doc(
        True, "Count the FLOPs of the first batch (torch's formulas) for TFLOP/s and MFU."
    )
    warn_data_wait: float = doc(
        0.1,
        "Warn (once) when waiting for data takes more than this share of the step time, at least "
        "5 ms a batch and 1 s in all after the first window (0: never).",
        min=0,
    )


def validate(cfg: Config, world) -> None:
    """The window's bound is declared on the field; nothing else to check before launch."""


def build(cfg: Config, ctx):
    from framework.callbacks.throughput.callback import Throughput

    peak = (ctx.config.get("trainer") or {}).get("peak_tflops")
    return Throughput(cfg, ctx.data_parallel[1], peak)
