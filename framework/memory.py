"""This process's resident memory, as Linux reports it (/proc/self): the high-water mark since a
reset, for the reports of what loading a checkpoint or pretrained weights cost a rank, and the
process's own high-water mark across those resets."""

from __future__ import annotations

import contextlib
from pathlib import Path

_BEFORE_RESETS = 0  # the highest mark any reset cleared


def reset_peak_rss() -> int:
    """Reset this process's resident-memory high-water mark and return the current resident
    size in bytes (0 where unknown). The mark cleared is kept for `lifetime_peak_rss`."""
    global _BEFORE_RESETS
    _BEFORE_RESETS = max(_BEFORE_RESETS, status("VmHWM"))
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")
    return status("VmRSS")


def peak_rss() -> int:
    """The resident-memory high-water mark since the last reset, in bytes (0 where unknown)."""
    return status("VmHWM")


def lifetime_peak_rss() -> int:
    """The process's resident-memory high-water mark since it started, in bytes (0 where
    unknown): what `peak_rss` says, or a higher mark an earlier reset cleared."""
    return max(_BEFORE_RESETS, status("VmHWM"))


def bytes_read() -> int:
    """Bytes this process has read through read system calls so far (the kernel's `rchar` in
    /proc/self/io: page cache hits included, so what a reader asked for, not what the disk did;
    0 where unknown)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("rchar:"):
                return int(line.split()[1])
    return 0


def status(field_name: str) -> int:
    """A /proc/self/status memory field (kB there) in bytes, 0 where unknown."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) * 1024
    return 0
