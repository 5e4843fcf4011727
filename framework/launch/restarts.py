"""Restarts of a job's workers from its newest complete checkpoint: the loop launcher=local and
launcher=ray share (`launcher.max_restarts`), the failure they end with, and the record of each
restart in run.json."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

from framework.checkpoint import disk

log = logging.getLogger("framework.launcher")

__all__ = ["WorkerFailure", "after", "record_restart", "with_restarts"]


class WorkerFailure(RuntimeError):
    """One or more worker processes failed; the message names each rank and its error."""


def with_restarts(
    max_restarts: int,
    run_dir: Path,
    resume_from: Path | None,
    start: Callable[[int, Path | None], str | None],
) -> None:
    """Run `start(attempt, resume_from)` (one start of every worker: None when they finished,
    else what failed) until the workers finish, each restart from the newest checkpoint this
    job completed (else where it began), checked as a resume is before it is loaded (a
    checkpoint that names more than data ends the job, unless the run trusts its checkpoints);
    raises WorkerFailure once `max_restarts` are spent."""
    for attempt in range(max_restarts + 1):
        if attempt:
            resume_from = disk.newest_complete(run_dir / "checkpoints") or resume_from
            check_restart(run_dir, resume_from)
        failure = start(attempt, resume_from)
        if failure is None:
            return
        if attempt == max_restarts:
            raise WorkerFailure(failure + after(attempt))
        log.warning("Restart %d of %d after: %s", attempt + 1, max_restarts, failure)
        record_restart(run_dir, attempt + 1, failure)


def check_restart(run_dir: Path, ckpt: Path | None) -> None:
    """A checkpoint a restart resumes from reads as data (framework/checkpoint/safe.py), as the
    one the job started from was checked before launch (a run that trusts its checkpoints: its
    tree only, no link); WorkerFailure otherwise. Called once per node by `with_restarts` and by
    each elastic generation of launcher=local; a SLURM requeue leaves it to each task's own
    load (type-restricted, and its open refuses links: formats.open_checkpoint), rather than
    every task reading every file of the checkpoint."""
    import yaml

    from framework.checkpoint.formats import check_checkpoint
    from framework.checkpoint.safe import UnsafeCheckpoint, check_tree

    if ckpt is None:
        return
    config = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
    trusted = (config.get("run") or {}).get("trust_checkpoint")
    try:
        if trusted:
            check_tree(ckpt)
        else:
            check_checkpoint(ckpt)
    except UnsafeCheckpoint as err:
        raise WorkerFailure(f"the checkpoint to restart from is refused: {err}") from None


def after(restarts: int) -> str:
    """' (after N restarts)' for a failure that ends a job which restarted (else '')."""
    return f" (after {restarts} restart{'s' * (restarts > 1)})" if restarts else ""


def record_restart(run_dir: Path, attempt: int, cause: str) -> None:
    """Each restart and its cause, kept in run.json."""
    from framework.context import load_run_state
    from framework.secrets import process_secrets, redact_text

    state = load_run_state(run_dir)
    cause = redact_text(cause, process_secrets())  # a task's exception may hold a secret
    state.setdefault("restarts", []).append(
        {"attempt": attempt, "time": time.time(), "cause": cause}
    )
    disk.write_json_atomic(run_dir / "run.json", state)
