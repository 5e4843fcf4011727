"""How a start of the workers ended, told to the user: the ranks that failed and why (read from
the error file each worker writes), or a preemption with the checkpoint to continue from."""

from __future__ import annotations

import json
from pathlib import Path

from framework.errors import EXIT_PREEMPTED
from framework.secrets import process_secrets, redact_text


class WorkersPreempted(RuntimeError):
    """The workers stopped on SIGTERM/SIGUSR1 after saving a checkpoint."""

    exit_code = EXIT_PREEMPTED


def preempted_message(run_dir: Path) -> str:
    from framework.checkpoint import disk

    newest = disk.listing(run_dir / "checkpoints")
    where = f"checkpoint saved at step {newest[0][0]}" if newest else "a checkpoint was saved"
    return f"preempted: {where}; run the same command to continue"


def describe_failures(err, log_dir: Path, ended: dict[int, tuple[float, str]] | None = None) -> str:
    """'rank N failed: ExceptionType: message' for every failed rank, the first one first.

    The error files every worker writes are read directly: with forked workers the launcher's
    own report names only one failure, often a rank that died because of another one. `ended`
    (from ExitWatch) adds the ranks that died without a Python exception (a signal, a crash)
    before any rank raised; the ones that ended later were stopped by the launcher.
    """
    found: dict[int, tuple[float, str]] = {}
    for path in log_dir.rglob("error.json"):
        try:
            data = json.loads(path.read_text())["message"]
            when = path.stat().st_mtime  # finer than the file's own whole-second timestamp
            found[int(path.parent.name)] = (when, str(data.get("message", "")).strip())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
    first_raise = min((when for when, _ in found.values()), default=float("inf"))
    for rank, (when, how) in (ended or {}).items():
        if rank not in found and when <= first_raise:
            found[rank] = (when, f"no Python exception recorded ({how})")
    for rank, failure in err.failures.items():
        if rank not in found:
            code = failure.exitcode
            how = f"exit code {code}" if code >= 0 else f"killed by signal {failure.signal_name()}"
            found[rank] = (float(failure.timestamp), f"no Python exception recorded ({how})")
    ordered = sorted(found.items(), key=lambda kv: kv[1][0])
    text = "\n".join(f"rank {rank} failed: {message}" for rank, (_, message) in ordered)
    # printed, and kept in run.json when the job restarts: the task's exception may hold a
    # secret value (the worker's error file has it as raised)
    return redact_text(text, process_secrets())
