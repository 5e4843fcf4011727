"""The Lightning callback behind `callbacks.profile` (imports Lightning: loaded in workers)."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch

log = logging.getLogger("framework.profile")


def fit_schedule(wait: int, warmup: int, active: int, steps_left: float) -> tuple[int, int, int]:
    """(wait, warmup, active) cut to `steps_left` steps: wait first, then warmup, then active."""
    over = max(wait + warmup + active - steps_left, 0)
    cut_wait = min(wait, over)
    cut_warmup = min(warmup, over - cut_wait)
    cut_active = min(active - 1, over - cut_wait - cut_warmup)
    return int(wait - cut_wait), int(warmup - cut_warmup), int(active - cut_active)


class Profile(pl.Callback):
    """Starts torch.profiler at the first training batch, steps it after every optimizer
    step, writes this rank's trace when the active steps end."""

    def __init__(self, cfg, out: Path) -> None:
        self.cfg = cfg
        self.out = out  # RUN_DIR/profile
        self.prof = None
        self.rank = 0
        self.cuda = False
        self.last_step = 0  # trainer.global_step when the profiler last stepped
        self.steps = 0  # optimizer steps since the profiler started
        self.active_from = 0  # the first recorded step, counted like `steps`
        self.first = 0  # trainer.global_step of the first recorded step
        self.recording_memory = False
        self.saved = False

    def on_train_start(self, trainer, pl_module) -> None:
        left = trainer.estimated_stepping_batches - trainer.global_step
        if left < 1:
            return
        wait, warmup, active = fit_schedule(self.cfg.wait, self.cfg.warmup, self.cfg.active, left)
        cut = (wait, warmup, active) != (self.cfg.wait, self.cfg.warmup, self.cfg.active)
        if cut and trainer.is_global_zero:
            log.warning(
                "callbacks.profile: %d steps left, fewer than wait+warmup+active=%d: "
                "tracing wait=%d warmup=%d active=%d (raise trainer.max_steps for all)",
                left,
                self.cfg.wait + self.cfg.warmup + self.cfg.active,
                wait,
                warmup,
                active,
            )
        self.rank = trainer.global_rank
        self.cuda = trainer.strategy.root_device.type == "cuda"
        self.last_step = trainer.global_step
        self.active_from = wait + warmup
        self.first = trainer.global_step + self.active_from
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.out.mkdir(parents=True, exist_ok=True)
        self.prof = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(wait=wait, warmup=warmup, active=active, repeat=1),
            on_trace_ready=self.save,
            record_shapes=self.cfg.record_shapes,
            profile_memory=self.cfg.profile_memory,
            with_stack=self.cfg.with_stack,
        )
        self.prof.start()
        self.record_memory()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.prof is None or self.saved or trainer.global_step == self.last_step:
            return  # not profiling, done, or a batch that only accumulated gradients
        self.last_step = trainer.global_step
        self.steps += 1
        self.prof.step()  # after the last active step: stops and calls self.save
        self.record_memory()

    def record_memory(self) -> None:
        """On CUDA, keep the allocator's history from the first active step on."""
        if self.cuda and not self.saved and self.steps == self.active_from:
            torch.cuda.memory._record_memory_history(max_entries=200_000)
            self.recording_memory = True

    def save(self, prof) -> None:
        prof.export_chrome_trace(str(self.out / f"trace-rank{self.rank}.json"))
        if self.recording_memory:
            torch.cuda.memory._dump_snapshot(str(self.out / f"memory-rank{self.rank}.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)
            self.recording_memory = False
        self.saved = True

    def stop(self) -> None:
        """Stop a profiler still running (the run ended early); keep recorded steps."""
        prof, self.prof = self.prof, None
        if prof is None or self.saved:
            return
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Incorrect schedule: RECORD followed by NONE"
            prof.stop()  # in the last active step, this saves already
        if not self.saved and self.steps > self.active_from:
            self.save(prof)
        elif self.recording_memory:
            torch.cuda.memory._record_memory_history(enabled=None)
            self.recording_memory = False

    def on_train_end(self, trainer, pl_module) -> None:
        self.stop()
        if not (self.saved and trainer.is_global_zero):
            return
        last = self.first + self.steps - self.active_from - 1
        steps = f"steps {self.first}-{last}" if last > self.first else f"step {self.first}"
        memory = (
            f"; memory snapshots {self.out}/memory-rank*.pickle at https://pytorch.org/memory_viz"
            if self.cuda
            else ""
        )
        log.info(
            "Profiler traces of %s in %s/trace-rank*.json (one per rank): open one at "
            "https://ui.perfetto.dev or chrome://tracing%s",
            steps,
            self.out,
            memory,
        )

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self.stop()  # also after an exception, which skips on_train_end
