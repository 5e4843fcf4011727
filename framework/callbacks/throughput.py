"""`callbacks.throughput`: speed, FLOP/s, MFU, memory and data wait of training, as metrics.

Every `window` optimizer steps rank 0 logs, averaged over the window (validation excluded):

| metric | meaning |
|---|---|
| perf/steps_per_sec | optimizer steps per second |
| perf/samples_per_sec | samples per second over the whole job (a batch counted once per data-parallel rank: tensor- and pipeline-parallel ranks share theirs) |
| perf/tokens_per_sec | tokens per second over the job, for batches whose input is a 2-D integer tensor (token ids) |
| perf/tflops_per_device | model FLOPs this rank computes per second, in 10^12 |
| perf/mfu | perf/tflops_per_device / the device's peak (trainer.peak_tflops, else the known GPU's dense bf16 peak); not logged when neither is known (the CPU) |
| perf/memory_peak_gib | CUDA: the most memory allocated so far; CPU: the process's peak resident set |
| perf/memory_reserved_gib | CUDA: the most memory the caching allocator reserved so far |
| perf/data_wait_ms | the time from the end of one batch to the start of the next, in which the loader hands over the next batch; a warning names the loader when it exceeds `warn_data_wait` of the step time |

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
        "Warn (once) when waiting for data takes more than this share of the step time (0: never).",
        min=0,
    )


def validate(cfg: Config, world) -> None:
    """The window's bound is declared on the field; nothing else to check before launch."""


def tokens_in(batch) -> int:
    """Token ids in a batch: the elements of its input when that is a 2-D integer tensor."""
    import torch

    first = batch[0] if isinstance(batch, (list, tuple)) and batch else batch
    if isinstance(first, dict):
        first = first.get("input_ids", first.get("tokens"))
    if torch.is_tensor(first) and first.dim() == 2 and not first.is_floating_point():
        return int(first.numel())
    return 0


def rows_in(batch) -> int:
    import torch

    first = batch[0] if isinstance(batch, (list, tuple)) and batch else batch
    if isinstance(first, dict):
        first = next((v for v in first.values() if torch.is_tensor(v)), None)
    return int(first.shape[0]) if torch.is_tensor(first) and first.dim() > 0 else 0


def peak_memory(device) -> tuple[float, float | None]:
    """(peak GiB, reserved GiB or None) of this process on `device`."""
    import resource

    import torch

    if device.type == "cuda":
        return (
            torch.cuda.max_memory_allocated(device) / 2**30,
            torch.cuda.max_memory_reserved(device) / 2**30,
        )
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, None  # KiB on Linux


def device_peak(configured: float | None, device) -> float | None:
    """TFLOP/s of one device: the configured figure, else the known GPU's, else None."""
    import torch

    from framework.perf import peak_tflops

    if configured:
        return float(configured)
    if device.type == "cuda":
        return peak_tflops(torch.cuda.get_device_name(device))
    return None


def build(cfg: Config, ctx):
    import logging
    import time

    import lightning.pytorch as pl

    data_ranks = ctx.data_parallel[1]
    configured_peak = (ctx.config.get("trainer") or {}).get("peak_tflops")

    class Throughput(pl.Callback):
        """Speed, FLOP/s and memory of training steps, logged on rank 0."""

        def __init__(self) -> None:
            self.reset()
            self.flops_per_batch: float | None = None
            self.counter = None
            self.batch_ended: float | None = None
            self.peak: float | None = None
            self.last_step = 0  # trainer.global_step at the last batch's end
            self.warned = False

        def reset(self) -> None:
            self.start: float | None = None
            self.steps = self.batches = self.samples = self.tokens = 0
            self.waited = 0.0

        def on_train_start(self, trainer, pl_module) -> None:
            self.peak = device_peak(configured_peak, trainer.strategy.root_device)
            self.last_step = trainer.global_step

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            now = time.perf_counter()
            if self.batch_ended is not None and self.start is not None:
                self.waited += now - self.batch_ended
            if cfg.count_flops and self.flops_per_batch is None and self.counter is None:
                from framework.perf import flop_counter

                self.counter = flop_counter()
                self.counter.__enter__()
                return  # the counted batch is slow: it starts no window
            if self.start is None:
                self.start = now

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if self.counter is not None:
                self.counter.__exit__(None, None, None)
                self.flops_per_batch = float(self.counter.get_total_flops())
                self.counter = None
                pl_module.log("perf/flops_per_batch", self.flops_per_batch, rank_zero_only=True)
                self.batch_ended = None
                self.last_step = trainer.global_step
                return
            self.batch_ended = time.perf_counter()
            if self.start is None:
                return
            self.batches += 1
            self.samples += rows_in(batch) * data_ranks  # tensor/pipeline ranks share a batch
            self.tokens += tokens_in(batch) * data_ranks
            if trainer.global_step == self.last_step:
                return  # a batch that only accumulated gradients
            self.last_step = trainer.global_step
            self.steps += 1
            if self.steps >= cfg.window:
                self.emit(pl_module, time.perf_counter() - self.start, trainer)
                self.reset()
                self.batch_ended = None

        def emit(self, pl_module, seconds: float, trainer) -> None:
            log = lambda name, value: pl_module.log(name, value, rank_zero_only=True)  # noqa: E731
            log("perf/steps_per_sec", self.steps / seconds)
            if self.samples:
                log("perf/samples_per_sec", self.samples / seconds)
            if self.tokens:
                log("perf/tokens_per_sec", self.tokens / seconds)
            if self.flops_per_batch:
                tflops = self.flops_per_batch * self.batches / seconds / 1e12
                log("perf/tflops_per_device", tflops)
                if self.peak:
                    log("perf/mfu", tflops / self.peak)
            if self.batches > 1:
                log("perf/data_wait_ms", 1000 * self.waited / (self.batches - 1))
                self.warn_waiting(trainer, self.waited / seconds)
            peak, reserved = peak_memory(trainer.strategy.root_device)
            log("perf/memory_peak_gib", peak)
            if reserved is not None:
                log("perf/memory_reserved_gib", reserved)

        def warn_waiting(self, trainer, share: float) -> None:
            if self.warned or not cfg.warn_data_wait or share <= cfg.warn_data_wait:
                return
            self.warned = True
            loader = trainer.train_dataloader
            dataset = type(getattr(loader, "dataset", None)).__name__
            workers = getattr(loader, "num_workers", "?")
            logging.getLogger("framework.throughput").warning(
                "Training waits for data %.0f%% of the time (over %g%%: "
                "callbacks.throughput.warn_data_wait): the loader of %s with num_workers=%s "
                "does not keep up. Give it more workers, or make __getitem__ cheaper.",
                100 * share,
                100 * cfg.warn_data_wait,
                dataset,
                workers,
            )

        def on_validation_start(self, trainer, pl_module) -> None:
            self.reset()
            self.batch_ended = None

        def on_exception(self, trainer, pl_module, exception) -> None:
            if self.counter is not None:
                self.counter.__exit__(None, None, None)
                self.counter = None

    return Throughput()
