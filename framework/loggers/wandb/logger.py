"""The W&B logger behind `logger=wandb` (imports wandb and Lightning: loaded in workers)."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities import rank_zero_only

from framework import secrets

log = logging.getLogger("framework.wandb")


class RunWandbLogger(WandbLogger):
    """Lightning's WandbLogger that says how to upload an offline run when training ends. It
    has the optional logger hooks of framework.plugins (`CheckpointUploader`: log_checkpoint,
    wait_staged, log_staged; `SeparateWriter`: wait_received), which the checkpoint callback
    calls."""

    def __init__(
        self,
        offline_dir: str | None = None,
        clean=None,
        log_checkpoints: str = "none",
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self._offline_dir = offline_dir
        self._clean = clean or (lambda params: params)
        self._lost: str | None = None  # why W&B stopped taking records, once it did
        self.log_checkpoints = log_checkpoints  # logger.wandb.log_model: none|last|best|all
        self.uploaded: dict[int, list[str]] = {}  # step -> aliases, for this job's uploads
        self._newest: Any = None  # the version `last` uploaded most recently
        self._pruner: threading.Thread | None = None
        self._staging: list[dict[str, Any]] = []  # copied in the background, then logged

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
    def wait_received(self) -> None:
        """Wait (5 s at most) until W&B's service process has every record logged so far: it
        writes the run file (offline: the record `wandb sync` uploads), so they outlive a kill
        of this process. A round trip (about 0.5 ms), so called before a checkpoint commits, not
        after every step as Lightning calls `save()`."""
        self._unless_lost(self._wait_received)

    def _wait_received(self) -> None:
        interface = getattr(self._experiment, "_interface", None)  # none: disabled, or not begun
        if interface is None:
            return
        try:
            interface.deliver_history_step().wait_or(timeout=5)
        except TimeoutError:  # a busy service: the checkpoint does not wait on it any longer
            log.warning("W&B's service did not confirm the metrics within 5 s")

    @rank_zero_only
    def log_checkpoint(self, path: Path, meta: dict[str, Any], best: bool) -> None:
        """Upload a committed checkpoint as a version of the artifact `model-<run id>`, as
        `log_model` asks: last (alias latest), best (alias best, only when `best`), all (aliases
        latest and step-N, plus best). Its files are copied to W&B's staging area in a thread;
        `log_staged` then logs it, from the training thread. A failed upload is a warning."""
        which, step = self.log_checkpoints, int(meta["step"])
        if which == "none" or self._lost is not None or step in self.uploaded:
            return
        if which == "best" and not best:
            return
        aliases = {"last": ["latest"], "best": ["best", f"step-{step}"]}.get(
            which, ["latest", f"step-{step}"] + (["best"] if best else [])
        )
        self.uploaded[step] = aliases
        try:
            import wandb

            keep = ("run_id", "step", "epoch", "metrics", "world_size", "format", "config_hash")
            artifact = wandb.Artifact(
                f"model-{self.experiment.id}",
                type="model",
                metadata={**{k: meta.get(k) for k in keep}, "checkpoint": str(path)},
            )
        except Exception as err:
            log.warning("W&B: checkpoint %s was not uploaded (%s)", path, err)
            return
        staged = {"path": path, "artifact": artifact, "aliases": aliases, "error": None}
        staged["thread"] = threading.Thread(target=stage, args=(staged,), daemon=True)
        staged["thread"].start()
        self._staging.append(staged)

    def wait_staged(self) -> None:
        """Wait until every checkpoint being uploaded is copied to W&B's staging area: then
        pruning may delete it (any thread may call this)."""
        for staged in list(self._staging):
            staged["thread"].join()

    @rank_zero_only
    def log_staged(self, wait: bool = False) -> None:
        """Log the checkpoints whose copy is complete, in the order they were saved (`wait`:
        all of them). Called from the training thread at step boundaries and at the end."""
        while self._staging and (wait or not self._staging[0]["thread"].is_alive()):
            staged = self._staging.pop(0)
            staged["thread"].join()
            if staged["error"] is None and self._lost is None:
                try:
                    self._log_artifact(staged)
                    continue
                except (ConnectionError, BrokenPipeError, EOFError) as err:
                    self._lost = f"{type(err).__name__}: {err}"
                    log.warning("W&B stopped logging (%s); training goes on", self._lost)
                except Exception as err:  # a refused artifact: the checkpoint is still here
                    staged["error"] = err
            if staged["error"] is not None:
                log.warning(
                    "W&B: checkpoint %s was not uploaded (%s)", staged["path"], staged["error"]
                )

    def _log_artifact(self, staged: dict[str, Any]) -> None:
        run, artifact, aliases = self.experiment, staged["artifact"], staged["aliases"]
        logged = run.log_artifact(artifact, aliases=aliases)
        log.info(
            "W&B: checkpoint %s logged as %s (%s)",
            staged["path"].name,
            artifact.name,
            ", ".join(aliases),
        )
        if self.log_checkpoints == "last" and run.settings.mode == "online":
            self._supersede(logged)

    def _supersede(self, logged: Any) -> None:
        """`last` keeps one version per job: once the new one is uploaded, the one it replaces
        is deleted (online only; offline, every version is recorded and synced)."""
        previous, self._newest = self._newest, logged
        if previous is None:
            return
        self._wait_pruner()
        self._pruner = threading.Thread(
            target=delete_when_uploaded, args=(logged, previous), daemon=True
        )
        self._pruner.start()

    def _wait_pruner(self, timeout: float | None = None) -> None:
        if self._pruner is not None:
            self._pruner.join(timeout)
            self._pruner = None

    @rank_zero_only
    def finalize(self, status: str) -> None:
        self.log_staged(wait=True)
        self._wait_pruner(timeout=120)
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


def stage(staged: dict[str, Any]) -> None:
    """Copy a checkpoint's files into W&B's staging area (with their digests): pruning may
    delete the checkpoint before the upload, or `wandb sync`, reads it. Runs in a thread."""
    try:
        staged["artifact"].add_dir(str(staged["path"]))
    except Exception as err:  # a full disk: reported by log_staged
        staged["error"] = err


def delete_when_uploaded(new: Any, old: Any) -> None:
    """Delete the version `old` once `new` is on the server (runs in a thread; best effort)."""
    try:
        new.wait()
        old.wait()
        old.delete(delete_aliases=True)
    except Exception as err:  # a server hiccup: an extra version stays, nothing is lost
        log.warning("W&B: the superseded checkpoint version was not deleted (%s)", err)


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
    return RunWandbLogger(
        offline_dir=offline_dir,
        experiment=run,
        clean=ctx.clean,
        log_checkpoints=cfg.log_model,
        **kwargs,
    )


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
    with redacted_argv(secrets.key_pattern(ctx.secret_keys), ctx.secret_values):
        if mode == "online":
            try:
                return wandb.init(mode="online", settings=settings, **args)
            except Exception as err:  # unreachable server, bad key: keep training, log offline
                log.warning("W&B online init failed (%s); logging offline instead.", err)
                own_service(wandb)
                os.environ["WANDB_MODE"] = "offline"  # W&B's own telemetry too
                return wandb.init(mode="offline", settings=settings, **args)
        return wandb.init(mode=mode, settings=settings, **args)


def own_service(wandb) -> None:
    """After a failed online init, the offline run under the same id needs a W&B service that
    never saw the failed run: one this process started is stopped by the teardown, but one
    inherited from a parent process (WANDB_SERVICE, set by a script or notebook that used W&B
    before starting the job) lives on and refuses the id ("run ID ... is in use") until the
    failed run gives up. Dropping the inherited token makes the next init start this process's
    own service."""
    wandb.teardown()
    os.environ.pop(wandb.env.SERVICE, None)


@contextlib.contextmanager
def redacted_argv(pattern: re.Pattern[str], values: Iterable[str]):
    """W&B records the command line: show it with secrets replaced (by key, including
    run.secret_keys; URL passwords; secret values)."""
    saved = list(sys.argv)
    sys.argv = secrets.redact_words(saved, pattern, values)
    try:
        yield
    finally:
        sys.argv = saved
