"""framework.memory: the load reports reset the resident high-water mark to measure one phase;
the process's own peak (what `framework.debug.PeakMemory` reports) still counts what came before.
Measured in a fresh process with glibc's default allocator settings: a test worker's allocator
may be configured (framework.allocator) to serve the block from memory it already holds, and its
resident size would not move."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

MEASURE = """
import json, torch
from framework import memory
start = memory.status("VmRSS")
block = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
high = memory.status("VmRSS")
del block
memory.reset_peak_rss()  # a load report measuring its own phase
print(json.dumps({"start": start, "high": high, "phase": memory.peak_rss(),
                  "lifetime": memory.lifetime_peak_rss()}))
"""


def test_a_reset_clears_the_phase_mark_but_not_the_lifetime_peak():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUN"))}
    out = subprocess.run(
        [sys.executable, "-c", MEASURE],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    m = json.loads(out.stdout.splitlines()[-1])
    assert m["high"] - m["start"] > 48 * 2**20, m
    assert m["phase"] < m["high"] - 32 * 2**20, "the phase's mark starts where the phase does"
    assert m["lifetime"] > m["start"] + 48 * 2**20, "the block before the reset counts"
