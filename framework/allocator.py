"""How a training process's CPU memory is handed back to the kernel (`trainer.malloc`).

glibc's `malloc` serves a large block with its own `mmap` (unmapped again on `free`), and trims
the top of its heap once more than a threshold lies free there. Both thresholds adapt to what
the process has freed so far, so whether the step's large tensors (activations, gradients) are
reused in place or handed back and faulted in again, a zero-filled page at a time, on the next
step depends on the heap's history, not on the training code: on the digits benchmark at its
large size (benchmarks/overhead.py) fw and plain Lightning make the same 7 allocations of 1 MiB
or more a step (57 MiB), and take anywhere from 1,300 to 6,400 minor page faults a step, from
run to run of the same command.

`auto` (the default) is `reuse` when the job trains on the CPU, whose steps allocate their
tensors there, and `system` on CUDA, where a step's tensors live on the device and a one-off host
peak (a checkpoint staged in host memory) would otherwise stay resident. `reuse` fixes both
thresholds once, at the start of each training process: blocks up to
`MMAP_THRESHOLD` come from the heap, and the heap's top goes back to the kernel only past
`TRIM_THRESHOLD`. Freed memory then stays mapped for the next step: no page faults a step, and
a resident size that stays at its peak instead of falling between steps. `system` leaves glibc's
defaults. Either way, MALLOC_* variables or a `glibc.malloc` tunable in the environment win
(the user set them), and anything but glibc on Linux is left alone.

What inherits it: a DataLoader worker forked from a training process (the settings are part of
its memory); not one started with `spawn` or `forkserver`. Threads' arenas share the thresholds,
but a block larger than a thread arena's heap (64 MiB) is still mapped on its own.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys

log = logging.getLogger("framework.allocator")

MODES = ("auto", "reuse", "system")
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
MMAP_THRESHOLD = 1 << 30  # a block of 1 GiB or more is mapped on its own, and unmapped when freed
TRIM_THRESHOLD = (1 << 31) - 1  # mallopt takes an int: the most it can keep free at the top
# glibc's variables for the same settings: set by the user, they win
ENV_NAMES = (
    "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_TRIM_THRESHOLD_",
    "MALLOC_TOP_PAD_",
    "MALLOC_MMAP_MAX_",
)


def mode_for(setting: str, on_cuda: bool) -> str:
    """The mode `trainer.malloc` asks for on this job's device ("auto": reuse on the CPU)."""
    if setting == "auto":
        return "system" if on_cuda else "reuse"
    return setting


def configure(mode: str, environ: dict[str, str] | None = None) -> str:
    """Apply `mode` (one of MODES) to this process's malloc; returns what was done, for the log
    and the tests: "reuse", or "skipped: <why>"."""
    environ = os.environ if environ is None else environ
    if mode == "system":
        return "skipped: trainer.malloc=system"
    if sys.platform != "linux":
        return f"skipped: not Linux ({sys.platform})"
    set_by_user = [name for name in ENV_NAMES if name in environ]
    if "glibc.malloc." in environ.get("GLIBC_TUNABLES", ""):
        set_by_user.append("GLIBC_TUNABLES")
    if set_by_user:
        return f"skipped: set in the environment ({', '.join(set_by_user)})"
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
        return "skipped: not glibc"
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    applied = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    applied = libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and applied
    if not applied:
        return "skipped: mallopt refused the thresholds"
    log.debug("malloc: blocks under %d bytes from the heap, kept mapped when freed", MMAP_THRESHOLD)
    return "reuse"
