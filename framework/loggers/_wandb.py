"""The W&B logger behind `logger=wandb` (imports wandb and Lightning: loaded in workers)."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import Any

from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities import rank_zero_only

from framework.secrets import REDACTED, SECRET

log = logging.getLogger("framework.wandb")


class RunWandbLogger(WandbLogger):
    """Lightning's WandbLogger that says how to upload an offline run when training ends."""

    def __init__(self, offline_dir: str | None = None, clean=None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._offline_dir = offline_dir
        self._clean = clean or (lambda params: params)
        self._lost: str | None = None  # why W&B stopped taking records, once it did

    def _unless_lost(self, fn, *args: Any) -> None:
        """W&B's service process can die under training (a scheduler signals every process of
        the job, e.g. SLURM's scancel): warn once, drop W&B, go on (metrics.csv keeps logging)."""
        if self._lost is not None:
            return
        try:
            fn(*args)
        except (ConnectionError, BrokenPipeError, EOFError) as err:
            self._lost = f"{type(err).__name__}: {err}"
            log.warning("W&B stopped logging (%s); training goes on", self._lost)

    @rank_zero_only
    def log_hyperparams(self, params: Any) -> None:
        """The task's hyperparameters, with secrets replaced (W&B's config and debug log)."""
        self._unless_lost(super().log_hyperparams, self._clean(params))

    @rank_zero_only
    def log_metrics(self, metrics: Any, step: int | None = None) -> None:
        self._unless_lost(super().log_metrics, metrics, step)

    @rank_zero_only
    def finalize(self, status: str) -> None:
        self._unless_lost(self._finish, status)
        if self._offline_dir:
            log.info(
                "W&B logged offline to %s; upload it with: wandb sync %s",
                self._offline_dir,
                self._offline_dir,
            )

    def _finish(self, status: str) -> None:
        super().finalize(status)
        if self._experiment is not None:  # end the run: the next job here gets its own
            self._experiment.finish(exit_code=0 if status == "success" else 1)


def make_logger(cfg, ctx, mode: str) -> RunWandbLogger:
    """Create the W&B run now on rank 0 (falling back to offline), a placeholder elsewhere."""
    kwargs = {"save_dir": str(ctx.run_dir), "id": ctx.run_id, "log_model": False}
    if rank_zero_only.rank != 0:
        return RunWandbLogger(**kwargs, mode="disabled")
    os.environ.setdefault("WANDB_SILENT", "true")
    if mode in ("offline", "disabled"):
        # Also W&B's process-wide settings: otherwise its usage telemetry still goes online.
        os.environ["WANDB_MODE"] = mode
    elif not os.environ.get("WANDB_MODE", "x"):
        del os.environ["WANDB_MODE"]  # an empty value makes wandb fail; it means "unset"
    run = init_run(cfg, ctx, mode)
    # Charts against the trainer's step, as Lightning sets up for the runs it creates itself.
    run.define_metric("trainer/global_step")
    run.define_metric("*", step_metric="trainer/global_step", step_sync=True)
    offline = run.settings.mode == "offline" and getattr(run, "dir", None)
    offline_dir = os.path.dirname(run.dir) if offline else None
    return RunWandbLogger(offline_dir=offline_dir, experiment=run, clean=ctx.clean, **kwargs)


def init_run(cfg, ctx, mode: str):
    import wandb

    args = {
        "id": ctx.run_id,
        "resume": "allow",
        "dir": str(ctx.run_dir),
        "project": cfg.project or os.environ.get("WANDB_PROJECT") or "framework",
        "entity": cfg.entity,
        "group": cfg.group or ctx.group,
        "tags": list(cfg.tags) or None,
        "name": cfg.name or ctx.run_name,
        "notes": cfg.notes,
        "config": ctx.config,
    }
    settings = wandb.Settings(
        init_timeout=cfg.init_timeout, disable_code=True, disable_git=True, silent=True
    )
    with redacted_argv():
        if mode == "online":
            try:
                return wandb.init(mode="online", settings=settings, **args)
            except Exception as err:  # unreachable server, bad key: keep training, log offline
                log.warning("W&B online init failed (%s); logging offline instead.", err)
                wandb.teardown()  # the failed run still holds its id in W&B's service
                mode = os.environ["WANDB_MODE"] = "offline"  # W&B's own telemetry too
        return wandb.init(mode=mode, settings=settings, **args)


@contextlib.contextmanager
def redacted_argv():
    """W&B records the command line: hide values of secret-looking `key=value` arguments."""
    saved = list(sys.argv)
    sys.argv = [
        f"{a.partition('=')[0]}={REDACTED}"
        if "=" in a and SECRET.search(a.partition("=")[0])
        else a
        for a in saved
    ]
    try:
        yield
    finally:
        sys.argv = saved
