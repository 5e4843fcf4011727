"""The launcher's preload for fast restarts (`launcher.fast_start`): the modules a start's workers
imported, imported in the `fw` process while they train, so that a restart's forked workers find
them imported."""

from __future__ import annotations

import contextlib
import sys
import threading
from pathlib import Path


class Preload:
    """While forked workers train: a thread that imports in this process the modules their
    local rank 0 named once its Trainer was built (framework.worker.name_modules), so that the
    workers of a restart, forked from this process, find them imported (about 0.2 s of each
    worker's start, measured with the kill campaign; the first start is unchanged)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fw-preload", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=60)

    def _run(self) -> None:
        import importlib

        from framework.worker import MODULES_FILE

        path = self.directory / MODULES_FILE
        while not path.exists():
            if self._stop.wait(0.2):
                return
        for name in path.read_text().split():
            if self._stop.is_set():
                return
            if name in sys.modules or name.startswith("__"):
                continue
            # one the fw process cannot import (a worker-only path, a module that insists on
            # the main thread) is left to the workers, as without this
            with contextlib.suppress(Exception):
                importlib.import_module(name)
