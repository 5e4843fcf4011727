"""`trainer.malloc` (framework/allocator.py): with `reuse`, a large block freed by one step is
reused by the next with no page faults; `system` and the user's own MALLOC_* variables leave
glibc as it is; a value outside the choices is refused before anything starts."""

from __future__ import annotations

import subprocess
import sys

import pytest

from framework import allocator
from framework.cli import main

# A child process frees a 64 MiB block and allocates it again; the faults of writing it again.
# With "fork", a process forked after configure does it (as a DataLoader worker would).
REFAULTS = """
import ctypes, os, resource, sys
from framework import allocator
print(allocator.configure(sys.argv[1], {}), file=sys.stderr)
if sys.argv[2:] == ["fork"] and os.fork():
    sys.exit(os.wait()[1])
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
size = 64 << 20
block = libc.malloc(size); ctypes.memset(block, 1, size); libc.free(block)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
block = libc.malloc(size); ctypes.memset(block, 1, size)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def refaults(mode: str, *how: str) -> int:
    done = subprocess.run(
        [sys.executable, "-c", REFAULTS, mode, *how],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(done.stdout)


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's malloc")
def test_reuse_keeps_a_freed_block_mapped_for_the_next_step():
    pages = (64 << 20) // 4096
    assert refaults("system") >= pages // 2  # glibc maps it afresh: every page faults again
    assert refaults("reuse") < 100
    assert refaults("reuse", "fork") < 100  # a forked DataLoader worker inherits it


class Mallopt:
    """libc's mallopt as configure sees it: records its calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def __call__(self, option: int, value: int) -> int:
        self.calls.append((option, value))
        return 1


class FakeLibc:
    """What configure sees of glibc."""

    def __init__(self) -> None:
        self.mallopt = Mallopt()
        self.calls = self.mallopt.calls

    def gnu_get_libc_version(self) -> bytes:
        return b"2.36"


@pytest.fixture
def libc(monkeypatch) -> FakeLibc:
    fake = FakeLibc()
    monkeypatch.setattr(allocator.sys, "platform", "linux")
    monkeypatch.setattr(allocator.ctypes, "CDLL", lambda name: fake)
    return fake


def test_reuse_sets_both_thresholds_and_system_sets_none(libc):
    assert allocator.configure("reuse", {}) == "reuse"
    assert libc.calls == [
        (allocator.M_MMAP_THRESHOLD, allocator.MMAP_THRESHOLD),
        (allocator.M_TRIM_THRESHOLD, allocator.TRIM_THRESHOLD),
    ]
    libc.calls.clear()
    assert allocator.configure("system", {}) == "skipped: trainer.malloc=system"
    assert libc.calls == []


@pytest.mark.parametrize(
    "environ, named",
    [
        ({"MALLOC_TRIM_THRESHOLD_": "4294967296"}, "MALLOC_TRIM_THRESHOLD_"),
        ({"MALLOC_MMAP_THRESHOLD_": "65536"}, "MALLOC_MMAP_THRESHOLD_"),
        ({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"}, "GLIBC_TUNABLES"),
    ],
)
def test_the_users_own_malloc_settings_win(libc, environ, named):
    assert allocator.configure("reuse", environ) == f"skipped: set in the environment ({named})"
    assert libc.calls == []


def test_elsewhere_than_linux_nothing_is_called(libc, monkeypatch):
    monkeypatch.setattr(allocator.sys, "platform", "darwin")
    assert allocator.configure("reuse", {}) == "skipped: not Linux (darwin)"
    assert libc.calls == []


def test_a_bad_value_is_refused_before_anything_starts(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code = main(["train", "task=digits", "trainer.malloc=keep", "run.dir=run"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "Traceback" not in err, err
    assert "trainer.malloc=keep: not a valid choice. Valid choices: auto, reuse, system." in err
    assert list(tmp_path.iterdir()) == [], "nothing written"


def test_a_training_process_applies_its_setting_before_training(tmp_path, monkeypatch):
    asked = []
    monkeypatch.setattr(allocator, "configure", lambda mode: asked.append(mode) or mode)
    monkeypatch.chdir(tmp_path)
    short = ["trainer.max_steps=1", "logger=[]", "callbacks=none", "trainer.malloc=system"]
    short += ["trainer.enable_progress_bar=false", "trainer.enable_model_summary=false"]
    assert main(["train", "task=digits", *short, "run.dir=run"]) == 0
    assert asked == ["system"]


def test_auto_reuses_on_the_cpu_and_leaves_glibc_alone_on_cuda():
    """A CUDA job's steps allocate on the device: keeping a one-off host peak resident (a
    checkpoint staged in host memory) would buy nothing there."""
    assert allocator.mode_for("auto", on_cuda=False) == "reuse"
    assert allocator.mode_for("auto", on_cuda=True) == "system"
    assert allocator.mode_for("reuse", on_cuda=True) == "reuse"
    assert allocator.mode_for("system", on_cuda=False) == "system"
