"""Processes the framework starts: the Python they run (and, for Ray's workers, what they find
on sys.path), and how a child is tied to the process that started it."""

from __future__ import annotations

import os
import sys
from typing import Any


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


# where a process the framework starts elsewhere (a Ray worker) finds the user's modules
USER_DIR_ENV = "FW_USER_DIR"


def find_user_modules(directory: str | None = None) -> None:
    """The user's modules in `directory` (default: $FW_USER_DIR, else the working directory)
    importable after the installed packages, and `directory` the working directory when it
    exists here: what `fw` does for itself, in a Python started without the directory first
    on sys.path (-P, or a Ray worker: `init_ray`)."""
    directory = directory or os.environ.get(USER_DIR_ENV) or os.getcwd()
    if not os.path.isdir(directory):  # a Ray node that does not share the directory
        return
    os.chdir(directory)
    if directory not in sys.path:
        sys.path.append(directory)


# Ray puts the directory the driver connects from first on every worker's sys.path, before the
# installed packages; the driver connects from here, where nobody but root puts a module
NEUTRAL_DIR = "/"


def init_ray(address: str | None, **options: Any) -> None:
    """`ray.init`, with the workers finding the user's modules as `fw` does: after the installed
    packages (a stray `torch.py` in the working directory is not imported in place of torch),
    and in the working directory when their node has it. Ray would put the driver's working
    directory first on each worker's sys.path: the driver connects from NEUTRAL_DIR instead,
    and each worker appends the user's directory when it starts (`find_user_modules`)."""
    import ray

    here = os.getcwd()
    runtime_env = {
        "env_vars": {USER_DIR_ENV: here},
        "worker_process_setup_hook": "framework.processes.find_user_modules",
    }
    os.chdir(NEUTRAL_DIR)
    try:
        ray.init(address=address, runtime_env=runtime_env, **options)
    finally:
        os.chdir(here)
