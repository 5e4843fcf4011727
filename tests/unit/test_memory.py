"""framework.memory: the load reports reset the resident high-water mark to measure one phase;
the process's own peak (what `framework.debug.PeakMemory` reports) still counts what came before."""

from __future__ import annotations

import sys

import pytest
import torch

from framework import memory

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def test_a_reset_clears_the_phase_mark_but_not_the_lifetime_peak():
    start = memory.status("VmRSS")
    block = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    high = memory.status("VmRSS")
    assert high - start > 48 * 2**20
    del block
    memory.reset_peak_rss()  # a load report measuring its own phase
    assert memory.peak_rss() < high - 32 * 2**20, "the phase's mark starts where the phase does"
    assert memory.lifetime_peak_rss() > start + 48 * 2**20, "the block before the reset counts"
