"""The Lightning callback behind `callbacks.throughput` (imports Lightning: loaded in workers)."""

from __future__ import annotations

import logging
import time

import lightning.pytorch as pl
import torch
from torch import Tensor

from framework.runtime.hooks import skip_unused

log = logging.getLogger("framework.throughput")

# A wait warned about is one that costs real time, not only a share of a short step. Below a few
# milliseconds a batch's wait is the fixed cost of a loader handing one over (the iterator's
# bookkeeping and collation: about 1 ms with num_workers=0, as the digits task's 0.7 ms in a
# 1.8 ms step), which more workers do not remove; and a run that has waited under a second in
# all since its warm-up has lost nothing a warning could win back. A 20-step toy run stays
# quiet; a loader that starves a real step (tens of ms a batch) reaches both within a few windows.
WAIT_PER_BATCH = 0.005  # seconds: the least mean wait per batch in a window that is warned about
WAIT_IN_ALL = 1.0  # seconds: the least wait summed over the windows after the warm-up


class Throughput(pl.Callback):
    """Speed, FLOP/s and memory of training steps, logged on rank 0.

    A batch costs two clock reads (the data wait: from one batch's end to the next one's start)
    and a look at its first tensor's shape. A window's figures are worked out when it closes and
    written to the loggers at the next step that Lightning writes to them, at that step: the same
    values reach the loggers as if every window were logged through Lightning, which writes only
    the newest value logged before a logging step. (They are not in `trainer.callback_metrics`.)"""

    def __init__(self, cfg, data_ranks: int, configured_peak: float | None) -> None:
        self.cfg = cfg
        self.data_ranks = data_ranks  # tensor/pipeline ranks share a batch
        self.configured_peak = configured_peak
        self.reset()
        self.flops_per_batch: float | None = None
        self.counter = None
        self.batch_ended: float | None = None
        self.peak: float | None = None
        self.last_step = 0  # trainer.global_step at the last batch's end
        self.warned = False
        self.windows_closed = 0  # the first is not judged (the loader starts up in it)
        self.waited_in_all = 0.0  # seconds of wait in the windows after the first
        self.figures: dict[str, float] | None = None  # the last closed window's, not yet logged
        skip_unused(self)

    def reset(self) -> None:
        self.start: float | None = None
        self.steps = self.batches = self.samples = self.tokens = 0
        self.waited = 0.0

    def on_train_start(self, trainer, pl_module) -> None:
        self.peak = device_peak(self.configured_peak, trainer.strategy.root_device)
        self.last_step = trainer.global_step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        now = time.perf_counter()
        if self.start is not None:
            if self.batch_ended is not None:
                self.waited += now - self.batch_ended
            return
        if self.cfg.count_flops and self.flops_per_batch is None and self.counter is None:
            from framework.perf import flop_counter

            self.counter = flop_counter()
            self.counter.__enter__()
            return  # the counted batch is slow: it starts no window
        self.start = now

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.counter is not None:
            self.counted(trainer, pl_module)
            return
        self.batch_ended = now = time.perf_counter()
        if self.start is None:
            return
        self.batches += 1
        rows, tokens = sizes_in(batch)
        self.samples += rows
        self.tokens += tokens
        step = trainer.global_step
        if step != self.last_step:  # else a batch that only accumulated gradients
            self.last_step = step
            self.steps += 1
            if self.steps >= self.cfg.window:
                self.figures = self.close(trainer, now - self.start)
        if self.figures is not None and trainer._logger_connector.should_update_logs:
            self.write(trainer)

    def write(self, trainer) -> None:
        """The last closed window's figures, straight to the loggers at the step Lightning
        writes now (as Lightning's LearningRateMonitor writes the rates): a `pl_module.log` per
        figure would cost Lightning's result bookkeeping for each, about 0.1 ms a step here."""
        if trainer.is_global_zero:
            step = trainer.fit_loop.epoch_loop._batches_that_stepped
            for logger in trainer.loggers:
                logger.log_metrics(self.figures, step=step)
        self.figures = None

    def counted(self, trainer, pl_module) -> None:
        self.counter.__exit__(None, None, None)
        self.flops_per_batch = float(self.counter.get_total_flops())
        self.counter = None
        pl_module.log("perf/flops_per_batch", self.flops_per_batch, rank_zero_only=True)
        self.batch_ended = None
        self.last_step = trainer.global_step

    def close(self, trainer, seconds: float) -> dict[str, float]:
        """The window's figures (the data-wait warning given now); a new window begins."""
        figures = {"perf/steps_per_sec": self.steps / seconds}
        if self.samples:
            figures["perf/samples_per_sec"] = self.samples * self.data_ranks / seconds
        if self.tokens:
            figures["perf/tokens_per_sec"] = self.tokens * self.data_ranks / seconds
        if self.flops_per_batch:
            tflops = self.flops_per_batch * self.batches / seconds / 1e12
            figures["perf/tflops_per_device"] = tflops
            if self.peak:
                figures["perf/mfu"] = tflops / self.peak
        if self.batches > 1:
            per_batch = self.waited / (self.batches - 1)
            figures["perf/data_wait_ms"] = 1000 * per_batch
            self.windows_closed += 1
            if self.windows_closed > 1:  # the first window holds the loader's start-up
                self.waited_in_all += self.waited
                self.warn_waiting(trainer, self.waited / seconds, per_batch)
        peak, reserved = peak_memory(trainer.strategy.root_device)
        figures["perf/memory_peak_gib"] = peak
        if reserved is not None:
            figures["perf/memory_reserved_gib"] = reserved
        self.reset()
        self.batch_ended = None
        return figures

    def warn_waiting(self, trainer, share: float, per_batch: float) -> None:
        """Warn once, on rank 0, when this window's wait exceeds the configured share of its
        time and also matters in seconds (WAIT_PER_BATCH, WAIT_IN_ALL)."""
        limit = self.cfg.warn_data_wait
        if self.warned or not limit or share <= limit or not trainer.is_global_zero:
            return
        if per_batch < WAIT_PER_BATCH or self.waited_in_all < WAIT_IN_ALL:
            return
        self.warned = True
        loader = trainer.train_dataloader
        dataset = type(getattr(loader, "dataset", None)).__name__
        workers = getattr(loader, "num_workers", "?")
        log.warning(
            "Training waits for data %.0f%% of the time (over %g%%: "
            "callbacks.throughput.warn_data_wait): the loader of %s with num_workers=%s "
            "does not keep up. Give it more workers, or make __getitem__ cheaper.",
            100 * share,
            100 * limit,
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


def sizes_in(batch) -> tuple[int, int]:
    """(rows, tokens) of a batch: the first dimension of its input (a dict's first tensor), and
    the elements of its token ids (the input, or a dict's `input_ids` or `tokens`) when that is a
    2-D integer tensor (else 0)."""
    first = batch[0] if isinstance(batch, (list, tuple)) and batch else batch
    ids = first
    if isinstance(first, dict):
        ids = first.get("input_ids", first.get("tokens"))
        first = next((v for v in first.values() if isinstance(v, Tensor)), None)
    rows = first.shape[0] if isinstance(first, Tensor) and first.dim() > 0 else 0
    integer = isinstance(ids, Tensor) and ids.dim() == 2 and not ids.is_floating_point()
    return int(rows), int(ids.numel()) if integer else 0


def peak_memory(device) -> tuple[float, float | None]:
    """(peak GiB, reserved GiB or None) of this process on `device`."""
    import resource

    if device.type == "cuda":
        return (
            torch.cuda.max_memory_allocated(device) / 2**30,
            torch.cuda.max_memory_reserved(device) / 2**30,
        )
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, None  # KiB on Linux


def device_peak(configured: float | None, device) -> float | None:
    """TFLOP/s of one device: the configured figure, else the known GPU's, else None."""
    from framework.perf import peak_tflops

    if configured:
        return float(configured)
    if device.type == "cuda":
        return peak_tflops(torch.cuda.get_device_name(device))
    return None
