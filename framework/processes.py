"""Processes the framework starts: the Python they run, and how a child is tied to the process
that started it."""

from __future__ import annotations

import os
import sys


def die_with_parent(sig: int | None = None) -> None:
    """Ask Linux to send `sig` (default SIGKILL) to this process when the process that started
    it dies (even by kill -9).

    The elastic launcher starts each worker in its own session, so without this an orphaned
    worker would go on training, and writing checkpoints, next to a restarted job. (`fw sweep`
    asks for SIGTERM for its trials' `fw train`: they checkpoint and stop.)
    """
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    pr_set_pdeathsig = 1
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(pr_set_pdeathsig, signal.SIGKILL if sig is None else sig, 0, 0, 0)
    if os.getppid() == 1:  # the parent died before the request took effect
        os._exit(1)


# `python -P`: the working directory is not put first on sys.path, so a stray `torch.py` there
# is not imported in place of torch (fw appends the directory, so the user's modules are still
# found). Python 3.10 has no -P: there, start fw from a directory whose Python files you trust.
SAFE_PATH = ("-P",) if sys.version_info >= (3, 11) else ()


def python(*args: str) -> list[str]:
    """The command line of a Python the framework starts: this interpreter, with -P."""
    return [sys.executable, *SAFE_PATH, *args]
