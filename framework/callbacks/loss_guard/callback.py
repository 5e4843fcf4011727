"""The Lightning callback behind `callbacks.loss_guard` (see loss_guard.py)."""

from __future__ import annotations

import json
import logging
import math
import statistics
from collections import deque
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist

from framework.checkpoint import disk
from framework.data.sampler import GlobalOrderSampler
from framework.runtime.hooks import skip_unused
from framework.strategy_base import StrategyBase
from framework.world import host_group

log = logging.getLogger("framework.loss_guard")
SKIPPED_FILE = "skipped.jsonl"
KEPT_POSITIONS = 100_000  # steps whose data position is remembered (a rollback's reach)
# below this loss scale an fp16 loss scaler cannot make the gradients finite any more: they are
# not finite by themselves (from 65536, 17 overflows in a row)
MIN_LOSS_SCALE = 1.0


class LossGuardStop(RuntimeError):
    """A bad step stopped the run (`callbacks.loss_guard.action=stop`)."""


class SpikeWindow:
    """The trailing good losses, and whether a loss spikes above mean + z x std of them."""

    def __init__(self, z: float, window: int, warmup: int) -> None:
        self.z = z
        self.warmup = warmup
        self.values: deque[float] = deque(maxlen=window)
        self.seen = 0  # good losses so far (the warm-up counts them)

    def threshold(self) -> float | None:
        """The loss above which a step spikes; None while warming up."""
        if self.seen < self.warmup or len(self.values) < 2:
            return None
        return statistics.fmean(self.values) + self.z * statistics.stdev(self.values)

    def add(self, loss: float) -> None:
        self.values.append(loss)
        self.seen += 1


def judge(
    loss: float, grads_finite: bool, window: SpikeWindow, scale: float | None = None
) -> str | None:
    """Why a step with this mean loss is bad, or None when it is good. Under an fp16 loss
    scaler (`scale`: its scale) non-finite gradients with a finite loss are the scaler's
    routine overflow (it skips the step and lowers its scale) until the scale falls below
    MIN_LOSS_SCALE."""
    if not math.isfinite(loss):
        return "non-finite loss"
    if not grads_finite and scale is None:
        return "non-finite gradient norm"
    if not grads_finite and scale < MIN_LOSS_SCALE:
        return f"non-finite gradients at every loss scale down to {scale:g}"
    if not grads_finite:
        return None
    limit = window.threshold()
    if limit is not None and loss > limit:
        return f"loss spike ({loss:.6g} > {limit:.6g}: mean + {window.z:g} x std of the last {len(window.values)})"
    return None


class LossGuard(pl.Callback):
    """Judges every step before the optimizer applies it; a bad one is skipped, rolled back or
    stops the run, decided alike on every rank (one all-reduce of the loss and a flag)."""

    def __init__(self, cfg, ctx) -> None:
        self.cfg = cfg
        self.run_dir = Path(ctx.run_dir)
        self.data_ranks = int(ctx.data_parallel[1])
        self.window = SpikeWindow(cfg.z, cfg.window, cfg.warmup)
        self.group: Any = None
        self.epoch = self.cursor = self.batch_idx = 0
        # step -> (epoch, first, end): the samples of that step, as positions in the epoch's
        # global order (all data ranks together)
        self.positions: dict[int, tuple[int, int, int]] = {}
        self.held: list[tuple[Any, str]] = []  # (object, method) held still until the next batch
        skip_unused(self)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        ckpt = _checkpointer(trainer)
        restored = ckpt.restored if ckpt is not None else None
        if restored:  # resumed: the data position goes on from the checkpoint's
            self.epoch, self.cursor = int(restored["epoch"]), int(restored["cursor"])
        if trainer.world_size > 1:  # a CPU flag on a gloo group, as the preemption vote
            self.group = host_group("loss-guard")

    def on_train_batch_start(self, trainer, pl_module, batch: Any, batch_idx: int) -> None:
        self.release_schedules()
        if trainer.current_epoch != self.epoch:
            self.epoch, self.cursor = trainer.current_epoch, 0
        self.batch_idx = batch_idx
        size = (getattr(trainer.train_dataloader, "batch_size", None) or 0) * self.data_ranks
        step = trainer.global_step
        first = self.positions.get(step, (self.epoch, self.cursor, 0))[1]  # accumulation
        self.positions[step] = (self.epoch, first, self.cursor + size)
        self.cursor += size
        if len(self.positions) > KEPT_POSITIONS:
            del self.positions[next(iter(self.positions))]

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        loss, grads_finite = self.agreed(trainer, pl_module)
        scale = loss_scale(trainer)
        reason = judge(loss, grads_finite, self.window, scale)
        if reason is None:
            if grads_finite:
                self.window.add(loss)
            else:  # the scaler's to handle: it skips the step and lowers its scale
                log.debug("callbacks.loss_guard: fp16 overflow at loss scale %g", scale)
            return
        step = trainer.global_step
        where = f"step {step} (epoch {trainer.current_epoch}, batch {self.batch_idx})"
        if self.cfg.action == "stop":
            raise LossGuardStop(
                f"callbacks.loss_guard: {reason} at {where}: stopped before the optimizer "
                "step; nothing of this step was saved"
            )
        for opt in trainer.optimizers:  # no gradient: the optimizer step changes nothing
            self.drop_gradients(opt)
        back_to = self.rollback(trainer) if self.cfg.action == "rollback" else None
        self.hold_schedules(trainer)
        steps = list(range(back_to, step + 1)) if back_to is not None else [step]
        ids = self.sample_ids(trainer, steps)
        record = {
            "step": step,
            "epoch": trainer.current_epoch,
            "batch": self.batch_idx,
            "reason": reason,
            "loss": loss if math.isfinite(loss) else str(loss),
            "action": "rollback" if back_to is not None else "skip",
            "rolled_back_to": back_to,
            "skipped_steps": steps,
            "sample_ids": ids,
        }
        if trainer.is_global_zero:
            with (self.run_dir / SKIPPED_FILE).open("a") as fh:
                fh.write(json.dumps(record) + "\n")
            done = (
                f"rolled back to the checkpoint of step {back_to}"
                if back_to is not None
                else "skipped"
            )
            log.warning(
                "callbacks.loss_guard: %s at %s: %s; %d sample(s) skipped (ids in %s): %s",
                reason,
                where,
                done,
                len(ids) if ids is not None else 0,
                self.run_dir / SKIPPED_FILE,
                ids if ids is not None and len(ids) <= 16 else "see the file",
            )

    def on_train_end(self, trainer, pl_module) -> None:
        self.release_schedules()

    # ---- the verdict, the same on every rank
    def agreed(self, trainer, pl_module) -> tuple[float, bool]:
        """The mean loss over the ranks that have one, and whether every gradient is finite."""
        strategy = trainer.strategy
        loss = strategy.step_loss() if isinstance(strategy, StrategyBase) else None
        stats = torch.zeros(3, dtype=torch.float64)
        if loss is not None:  # the closure's loss is divided by the accumulation
            stats[0] = float(loss) * trainer.accumulate_grad_batches
            stats[1] = 1.0
        if self.cfg.grad_norm and not grads_finite(pl_module):
            stats[2] = 1.0
        if self.group is not None:
            dist.all_reduce(stats, group=self.group)
        loss_mean = float(stats[0] / stats[1]) if stats[1] > 0 else 0.0
        return loss_mean, bool(stats[2] == 0)

    # ---- acting on a bad step
    def rollback(self, trainer) -> int | None:
        """Load the newest checkpoint of this run into every rank; its step, or None when
        there is none yet (the bad step is then skipped only)."""
        ckpt = _checkpointer(trainer)
        if ckpt is not None:  # a checkpoint of an earlier step still being written or committed
            ckpt.finish_pending(trainer)
            ckpt.release(trainer)
        trainer.strategy.barrier("loss-guard-rollback")
        path = disk.newest_complete(self.run_dir / "checkpoints")
        if path is None or getattr(trainer.strategy.inputs, "move_from", None) is not None:
            if trainer.is_global_zero:
                why = (
                    "no checkpoint yet" if path is None else "the run was moved from another layout"
                )
                log.warning("callbacks.loss_guard: cannot roll back (%s): the step is skipped", why)
            return None
        from framework.callbacks.checkpoint.callback import STATE_FILE

        connector = trainer._checkpoint_connector
        connector._loaded_checkpoint = trainer.strategy.load_checkpoint(
            path / STATE_FILE, weights_only=True
        )
        try:  # model, optimizer and schedules; the data position and the loops go on
            connector.restore_model()
            connector.restore_optimizers_and_schedulers()
        finally:
            connector._loaded_checkpoint = {}
        return int(disk.read_meta(path)["step"])

    def drop_gradients(self, optimizer) -> None:
        """Make the coming optimizer step change nothing. A torch optimizer passes by the
        parameters without a gradient (no update, no momentum, no weight decay). DeepSpeed's ZeRO
        optimizers keep the reduced gradients in their own buffers and step on them: for this
        step they find an overflow, as they would for a NaN, which clears the buffers and skips
        the update."""
        if hasattr(optimizer, "check_overflow") and hasattr(optimizer, "scaled_global_norm"):

            def overflowed(*args: Any, **kwargs: Any) -> None:
                optimizer.overflow = True

            def infinite(*args: Any, **kwargs: Any) -> torch.Tensor:
                return torch.tensor(math.inf)

            # in fp16 the overflow check finds it, in fp32 and bf16 the gradient norm
            optimizer.check_overflow, optimizer.scaled_global_norm = overflowed, infinite
            self.held += [(optimizer, "check_overflow"), (optimizer, "scaled_global_norm")]
        else:
            optimizer.zero_grad(set_to_none=True)

    def hold_schedules(self, trainer) -> None:
        """Lightning steps the step-interval schedules after every batch, applied or not: on a
        dropped step they hold still (their `step` is a no-op until the next batch starts)."""
        for config in trainer.lr_scheduler_configs:
            if config.interval == "step":
                config.scheduler.step = _hold
                self.held.append((config.scheduler, "step"))

    def release_schedules(self) -> None:
        """Undo what held a schedule or an optimizer still for one step."""
        for obj, name in self.held:
            obj.__dict__.pop(name, None)
        self.held = []

    def sample_ids(self, trainer, steps: list[int]) -> list[int] | None:
        """The dataset indices the steps trained on (all data ranks), or None when the loader
        does not draw them from the framework's global order."""
        sampler = getattr(trainer.train_dataloader, "sampler", None)
        if not isinstance(sampler, GlobalOrderSampler):
            return None
        ids: list[int] = []
        orders: dict[int, list[int]] = {}
        for step in steps:
            if step not in self.positions:
                continue
            epoch, first, end = self.positions[step]
            if epoch not in orders:
                orders[epoch] = _order_of(sampler, epoch)
            ids += orders[epoch][first:end]
        return ids


def _hold(*args: Any, **kwargs: Any) -> None:
    """A schedule's `step` while the optimizer step it follows was dropped."""


def loss_scale(trainer) -> float | None:
    """The scale of the precision plugin's gradient scaler (`16-mixed`), None without one (its
    steps' non-finite gradients are then never routine)."""
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    if scaler is None or not scaler.is_enabled():
        return None
    return float(scaler.get_scale())


def grads_finite(module: torch.nn.Module) -> bool:
    """Whether every gradient of this rank (its shards under FSDP) is finite."""
    grads = []
    for p in module.parameters():
        g = p.grad
        if g is not None:
            grads.append(g.to_local() if hasattr(g, "to_local") else g)
    if not grads:
        return True
    norms = torch._foreach_norm([g.detach() for g in grads])
    return bool(torch.isfinite(torch.stack([n.float() for n in norms])).all())


def _order_of(sampler: GlobalOrderSampler, epoch: int) -> list[int]:
    kept = sampler.epoch
    sampler.epoch = epoch
    try:
        return sampler.global_order().tolist()
    finally:
        sampler.epoch = kept


def _checkpointer(trainer: pl.Trainer) -> Any:
    from framework.callbacks.checkpoint.callback import Checkpointer

    return next((c for c in trainer.callbacks if isinstance(c, Checkpointer)), None)
