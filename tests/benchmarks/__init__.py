"""Tests of the benchmark scripts: each runs `python -m benchmarks.NAME` as a user does."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO, fw_env


def run_benchmark(module: str, *args: str, timeout: float) -> subprocess.CompletedProcess:
    """`python -m benchmarks.<module> ARGS` from the repository root; output captured as text."""
    return subprocess.run(
        [sys.executable, "-m", f"benchmarks.{module}", *args],
        cwd=REPO,
        env=fw_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
