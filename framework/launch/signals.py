"""The launcher's side of signals: a preemption signal the `fw` process receives is passed on
to its workers (its direct children), which checkpoint and exit 75."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)


@contextlib.contextmanager
def forward_signals(signums, seen: list[int] | None = None):
    """While workers run, pass SIGTERM/SIGUSR1/SIGUSR2 on (they checkpoint, then exit 75);
    each one passed on is appended to `seen`."""
    previous = {s: signal.getsignal(s) for s in signums}

    def forward(signum, frame):
        if seen is not None:
            seen.append(signum)
        signal_workers(signum)

    for s in signums:
        signal.signal(s, forward)
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def signal_workers(signum: int) -> None:
    """Send a signal to this process's workers (its direct children)."""
    for pid in child_pids(os.getpid()):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


def child_pids(parent: int) -> list[int]:
    """Direct children of a process (from /proc; empty where /proc is missing)."""
    pids = []
    for entry in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = entry.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == parent:
            pids.append(int(entry.parent.name))
    return pids
