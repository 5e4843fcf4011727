"""The Lightning callback behind `callbacks.checkpoint` (imports Lightning: loaded in workers)."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import threading
import time
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist

from framework import rng, watchdog
from framework.checkpoint import disk
from framework.checkpoint.portable import NAMES_KEY
from framework.data.order import resumable_part
from framework.data.sampler import GlobalOrderSampler
from framework.errors import EXIT_PREEMPTED
from framework.parallel.model import adapter_for
from framework.runtime.hooks import skip_unused
from framework.runtime.vote import PreemptionVote

log = logging.getLogger("framework.checkpoint")
PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)  # SLURM: --signal, scancel
STATE_FILE = "state.ckpt"


class Preempted(Exception):
    """Training stopped on SIGTERM/SIGUSR1/SIGUSR2 after saving a checkpoint; rerun to continue."""

    exit_code = EXIT_PREEMPTED

    def __init__(self, step: int, signum: int = 0) -> None:
        super().__init__(
            f"preempted: checkpoint saved at step {step}; run the same command to continue"
        )
        self.step = step
        self.signum = signum  # the signal the ranks agreed on (the highest number any got)


class Checkpointer(pl.Callback):
    """Atomic checkpoints with RNG and data position; resumable mid-epoch; preemption-aware."""

    def __init__(self, cfg, ctx) -> None:
        self.cfg = cfg
        self.ctx = ctx
        self.ckpt_dir = ctx.run_dir / "checkpoints"
        self.epoch = 0
        self.cursor = 0  # samples (all ranks together) consumed in `epoch`
        self.restored: dict[str, Any] | None = None
        self.rng_states: list[dict[str, Any]] = []
        self.last_saved = -1
        self.signal_received: int | None = None
        self.preempted_at: int | None = None
        self.preempted_by = 0  # the signal
        self._vote = PreemptionVote()
        self.names_recorded = False
        self.data_state: Any = None  # every rank's stateful sampler or dataset position
        self.pending: dict[str, Any] | None = None  # a checkpoint being written in the background
        self.uncommitted: tuple[Any, dict[str, Any]] | None = None  # written, commit held back
        self.stall = 0.0
        self.unannounced: list[Any] = []  # committed on rank 0, not yet shown to the loggers
        self.uploaders: list[Any] | None = None  # the loggers that upload checkpoints
        self.best_value: float | None = None  # of callbacks.checkpoint.monitor, so far
        self.best_read = False  # the earlier checkpoints' values were read
        self.monitor_checked = False  # `monitor` was found among the logged metrics
        skip_unused(self)  # Lightning passes by the per-step hooks it does not override

    @property
    def state_key(self) -> str:
        return "framework.checkpoint"

    # ---- state carried in every checkpoint
    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "cursor": self.cursor,
            "rng": self.rng_states,
            "run_id": self.ctx.run_id,
            "config_hash": self.ctx.config_hash,
            "world_size": self.ctx.world.world_size,
            "data_state": self.data_state,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.restored = state_dict

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # Lightning copies the task's (and data module's) saved hyperparameters in: no secrets
        for key in ("hyper_parameters", "datamodule_hyper_parameters"):
            if key in checkpoint:
                checkpoint[key] = self.ctx.clean(checkpoint[key])
        # Lightning's optimizer state is keyed by position; the names let another layout
        # (zero*, fsdp) match it to parameters on resume. Sharded optimizers carry their own.
        names = {id(p): n for n, p in pl_module.named_parameters()}
        groups = [[g["params"] for g in opt.param_groups] for opt in trainer.optimizers]
        self.names_recorded = all(id(p) in names for opt in groups for g in opt for p in g)
        if self.names_recorded:
            checkpoint[NAMES_KEY] = [[[names[id(p)] for p in g] for g in opt] for opt in groups]

    # ---- hooks
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.last_saved = trainer.global_step if self.restored else -1
        if self.restored is not None:
            self.epoch, self.cursor = int(self.restored["epoch"]), int(self.restored["cursor"])
            sampler = _global_order_sampler(trainer)
            own = resumable_part(trainer.train_dataloader)
            if sampler is not None:
                sampler.resume_at(self.epoch, self.cursor)
            states = self.restored.get("data_state") or []
            if own is not None and len(states) == trainer.world_size:
                own.load_state_dict(states[trainer.global_rank])
            elif own is not None and states:
                log.warning(
                    "The loader's own state was saved by another process count: not restored."
                )
            elif sampler is None and self.cursor:
                log.warning("The train loader's position could not be restored (see above).")
            restart_iterator(trainer)
        if self.cfg.on_preemption:
            for sig in PREEMPT_SIGNALS:  # installed after Lightning's own handlers, replacing them
                signal.signal(sig, self._on_signal)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module, batch: Any, batch_idx: int
    ) -> None:
        self.release(trainer)  # the previous step's metrics are logged by now
        # Lightning skips on_train_epoch_start when it restarts mid-epoch: detect epochs here.
        if trainer.current_epoch != self.epoch:
            self.epoch, self.cursor = trainer.current_epoch, 0
        if self.restored is not None and self.restored.get("rng"):
            states = self.restored["rng"]
            if trainer.global_rank < len(states):
                rng.restore(states[trainer.global_rank])
            self.restored["rng"] = None

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loader = trainer.train_dataloader
        per_rank = getattr(loader, "batch_size", None) or 0
        self.cursor += per_rank * self.ctx.data_parallel[1]
        step = trainer.global_step
        self.announce(trainer)  # the previous step's checkpoint, with its validation's metrics
        # a SIGTERM before on_train_start reached Lightning's handler (_vote.vote_on_sigterm)
        local = self.signal_received or (signal.SIGTERM if trainer.received_sigterm else 0)
        preempt = self.cfg.on_preemption and self._vote.agreed(local)
        due = self.cfg.every_n_steps is not None and step % self.cfg.every_n_steps == 0
        # The last step is saved here, not in on_train_end: by then Lightning has closed the
        # epoch, and a resume with a larger max_steps would start a new one.
        due = due or (self.cfg.save_on_train_end and 0 < trainer.max_steps <= step)
        self.finish_pending(trainer, wait=False)
        if (due or preempt) and step != self.last_saved and step > 0:
            self.save(trainer)
        if preempt:  # committed in on_train_end, once this step's metrics are logged
            self.preempted_at, self.preempted_by = step, preempt
            trainer.should_stop = True

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._rng_before_validation = rng.capture()
        self.release(trainer)  # validation runs after the step's training metrics are logged

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Validation leaves the RNG as it found it: a resumed run that does not repeat a
        # validation draws the same random numbers as one that ran it.
        rng.restore(self._rng_before_validation)
        if trainer.sanity_checking:
            return
        if not self.monitor_checked:
            self.check_monitor(trainer)
        if self.pending is not None and self.pending["step"] == trainer.global_step:
            self.finish_pending(trainer)  # this step's checkpoint is committed, then updated
        if trainer.global_step == self.last_saved and trainer.is_global_zero:
            # this step's checkpoint was written before its validation: record the new metrics
            disk.update_metrics(
                self.ckpt_dir / disk.name_for(self.last_saved), _scalar_metrics(trainer)
            )
            self._prune()
        step = trainer.global_step
        if self.cfg.every_n_steps is None and step != self.last_saved and step > 0:
            self.save(trainer)
        self.announce(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._vote.finish()
        self.release(trainer)
        step = trainer.global_step
        if self.cfg.save_on_train_end and step > 0 and step != self.last_saved:
            self.save(trainer)
            self.release(trainer)
        self.finish_pending(trainer)  # nothing is left half-written at exit
        self.announce(trainer)

    # ---- saving
    def _on_signal(self, signum: int, frame: Any) -> None:
        self.signal_received = signum  # acted on at the next step boundary, on every rank at once

    def _prune(self) -> None:
        cfg = self.cfg
        for logger in self.uploaders or []:  # a checkpoint being uploaded is copied first
            logger.wait_staged()
        disk.prune(self.ckpt_dir, cfg.keep_last, cfg.keep_best, cfg.monitor, cfg.mode)
        self._point_best()

    def _point_best(self) -> None:
        """Atomically point `checkpoints/best` (beside `last`) at the best checkpoint by
        `monitor`: what `fw test RUN_DIR` and `trainer.test_after_fit` read."""
        if not self.cfg.monitor:
            return
        best = disk.best(self.ckpt_dir, self.cfg.monitor, self.cfg.mode)
        if best is None:
            return
        tmp = self.ckpt_dir / ".best.tmp"
        if tmp.is_symlink() or tmp.exists():
            tmp.unlink()
        tmp.symlink_to(best.name)
        os.replace(tmp, self.ckpt_dir / "best")  # read by chosen_checkpoint (__init__.py)

    def check_monitor(self, trainer: pl.Trainer) -> None:
        """At the first validation: `monitor` names a metric the task logs, or the run stops
        here with the ones it does log (a misspelt name would otherwise rank nothing)."""
        self.monitor_checked = True
        logged = sorted(trainer.callback_metrics)
        if self.cfg.monitor is None or self.cfg.monitor in logged:
            return
        from framework.errors import ConfigError

        raise ConfigError(
            "callbacks.checkpoint.monitor",
            self.cfg.monitor,
            "no part of the task logs this metric (checked at the first validation)",
            logged,
            near=self.cfg.monitor,
        )

    def save(self, trainer: pl.Trainer) -> None:
        if trainer.fast_dev_run:  # a smoke test leaves no checkpoint, as Lightning's own
            return
        started = time.perf_counter()
        with watchdog.busy():  # however long the save takes, it is not a hang
            self.finish_pending(trainer)  # at most one background write in flight
            self._save(trainer, started)

    def _save(self, trainer: pl.Trainer, started: float) -> None:
        step = trainer.global_step
        tmp = self.ckpt_dir / (disk.name_for(step) + ".tmp")
        if trainer.is_global_zero:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        self.rng_states = _gather(rng.capture(), trainer.world_size)
        own = resumable_part(trainer.train_dataloader)
        self.data_state = _gather(own.state_dict(), trainer.world_size) if own else None
        trainer.strategy.barrier("checkpoint-dir")
        future = (
            trainer.strategy.save_async(trainer, tmp / STATE_FILE) if self.cfg.async_save else None
        )
        if future is None:  # the strategy writes in the foreground (StrategyBase.save_async)
            trainer.save_checkpoint(tmp / STATE_FILE, weights_only=False)
        self.stall = time.perf_counter() - started  # what training waited for this save
        meta = self._meta(trainer, step) if trainer.is_global_zero else {}
        self.rng_states = []
        self.last_saved = step
        if future is not None:  # rank 0 commits it once written and released, in the background
            self.pending = {"future": future, "step": step, "error": None}
            self.pending["released"] = threading.Event()
            if trainer.is_global_zero:
                commit = threading.Thread(
                    target=self._commit_when_written,
                    args=(future, tmp, meta, self.pending),
                    daemon=True,
                )
                self.pending["thread"] = commit
                commit.start()
            return
        self.uncommitted = (tmp, meta)

    def release(self, trainer: pl.Trainer) -> None:
        """Commit the checkpoint written at the last step, now that Lightning has logged that
        step's metrics (it does so after `on_train_batch_end`, where the save ran) and the loggers
        have written them out. A checkpoint of step N is then never on disk while a metrics row
        before N is not: a kill right after the commit resumes at N with every earlier row kept.
        A kill before the commit resumes from the checkpoint before, and logs those steps again."""
        waiting = self.pending is not None and not self.pending["released"].is_set()
        if self.uncommitted is None and not waiting:
            return  # most steps
        with watchdog.busy():  # the commit's digests of a large checkpoint are not a hang
            if trainer.is_global_zero:
                for logger in trainer.loggers:
                    logger.save()
                    if hasattr(logger, "wait_received"):  # it writes in another process
                        logger.wait_received()
            if self.uncommitted is not None:
                tmp, meta = self.uncommitted
                self.uncommitted = None
                if trainer.is_global_zero:
                    self.unannounced.append(self._commit(tmp, meta))
                trainer.strategy.barrier("checkpoint-commit")
            if waiting:
                self.pending["released"].set()

    def finish_pending(self, trainer: pl.Trainer, wait: bool = True) -> None:
        """Wait for the background write (and, on rank 0, its commit: DCP's coordinator finishes
        only after every rank wrote its part). `wait=False`: only forget it if it is done."""
        pending = self.pending
        if pending is None:
            return
        waiter = pending.get("thread")
        if not wait and (waiter.is_alive() if waiter else not pending["future"].done()):
            return
        # Waiting implies the step's metrics were logged (the callers come after release()):
        # set it regardless, as a waiter on an unreleased commit would wait forever.
        pending["released"].set()
        if waiter is not None:
            waiter.join()
        else:
            pending["future"].result()  # a failed write raises here
        self.pending = None
        if pending["error"] is not None:
            raise pending["error"]
        if pending.get("path") is not None:
            self.unannounced.append(pending["path"])

    def _commit_when_written(self, future, tmp, meta: dict[str, Any], pending: dict) -> None:
        try:
            future.result()
            pending["released"].wait()  # the step's metrics are written: see release()
            pending["path"] = self._commit(tmp, meta)
        except BaseException as err:  # raised in the training thread by finish_pending
            pending["error"] = err

    def _meta(self, trainer: pl.Trainer, step: int) -> dict[str, Any]:
        return {
            "step": step,
            "epoch": trainer.current_epoch,
            "run_id": self.ctx.run_id,
            "config_hash": self.ctx.config_hash,
            "config": self.ctx.config,
            "world_size": trainer.world_size,
            "metrics": _scalar_metrics(trainer),
            "time": time.time(),
            "format": self.ctx.checkpoint_format,
            "state": STATE_FILE,
            "parameter_names": self.names_recorded,
            # what each model family's export needs, as data (framework/parallel/model.py)
            "models": adapter_for(trainer.lightning_module).export_records(
                trainer.lightning_module
            ),
            # training's wait until the state was written (with async_save: copied, plus any
            # earlier write still in flight); the digests and rename of the commit come after
            "stall_s": self.stall,
        }

    def _commit(self, tmp, meta: dict[str, Any]):
        path = disk.commit(tmp, meta)
        self._prune()
        log.info("Checkpoint saved: %s", path)
        return path

    def announce(self, trainer: pl.Trainer) -> None:
        """Show committed checkpoints to the loggers that upload them (W&B's `log_model`), on
        rank 0. Held back until the step's validation has run (or the next step begins), so
        the metrics they carry, and which is best, are that step's. Called at every step
        boundary: the uploads whose files are copied are then logged."""
        if not self.unannounced and not self.uploaders:
            return  # most steps: nothing newly committed, no uploading logger to tell
        done, self.unannounced = self.unannounced, []
        if not trainer.is_global_zero:
            return
        if self.uploaders is None:
            self.uploaders = [lg for lg in trainer.loggers if hasattr(lg, "log_checkpoint")]
        for path in done if self.uploaders else []:
            if not path.is_dir():  # pruned already
                continue
            meta = disk.read_meta(path)
            best = self._new_best(meta.get("metrics", {}).get(self.cfg.monitor), done)
            for logger in self.uploaders:
                logger.log_checkpoint(path, meta, best)
        for logger in self.uploaders:
            logger.log_staged()

    def _new_best(self, value: float | None, done: list[Any]) -> bool:
        """Whether `value` of the monitored metric beats every earlier checkpoint's, including
        those pruned since and those of the jobs before a resume (read from disk once)."""
        if self.cfg.monitor is None or value is None:
            return False
        if not self.best_read:
            self.best_read = True
            now = {p.name for p in done}
            earlier = [p for _, p in disk.listing(self.ckpt_dir) if p.name not in now]
            values = [disk.read_meta(p).get("metrics", {}).get(self.cfg.monitor) for p in earlier]
            values = [v for v in values if v is not None]
            self.best_value = (max if self.cfg.mode == "max" else min)(values, default=None)
        better = self.best_value is None or (
            value > self.best_value if self.cfg.mode == "max" else value < self.best_value
        )
        if better:
            self.best_value = value
        return better


def _scalar_metrics(trainer: pl.Trainer) -> dict[str, float]:
    return {
        k: float(v)
        for k, v in trainer.callback_metrics.items()
        if isinstance(v, (int, float, torch.Tensor)) and torch.as_tensor(v).numel() == 1
    }


def _gather(state: dict[str, Any], world_size: int) -> list[dict[str, Any]]:
    if world_size == 1 or not (dist.is_available() and dist.is_initialized()):
        return [state]
    out: list[Any] = [None] * world_size
    dist.all_gather_object(out, state)
    return out


def restart_iterator(trainer: pl.Trainer) -> None:
    """Lightning starts iterating the train loader before any callback hook runs; with loader
    workers that draws the first indices from the sampler at once, before the resumed position
    was set. Nothing has been consumed yet, so the iterator is made again (the persistent workers
    stay) and starts where the run left off. The fetcher's length stays the whole epoch's, as
    Lightning counts it (it adds the batches already trained to those it fetches)."""
    loader = trainer.train_dataloader
    fetcher = getattr(trainer.fit_loop, "_data_fetcher", None)
    if getattr(loader, "num_workers", 0) > 0 and fetcher is not None:
        length = fetcher.length
        iter(fetcher)
        if length is not None:
            fetcher.length, fetcher.done = length, length == 0


def _global_order_sampler(trainer: pl.Trainer) -> GlobalOrderSampler | None:
    loader = trainer.train_dataloader
    sampler = getattr(loader, "sampler", None)
    return sampler if isinstance(sampler, GlobalOrderSampler) else None
