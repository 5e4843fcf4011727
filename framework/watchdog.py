"""Hang watchdog: workers beat on training progress; the launcher ends a job that stopped beating.

Worker side: each rank touches `rank{r}` in the heartbeat directory the launcher names in
`FW_HEARTBEAT_DIR` after every training and validation batch, marks `busy-rank{r}` while it
saves a checkpoint (a long save is not a hang) and once training has ended, and registers
faulthandler on STACK_SIGNAL so the launcher can ask for its Python stack. On CUDA, NCCL's own
error handling and flight recorder are switched on (`nccl_settings`).

Launcher side: a thread watches the beats. Once any rank has beaten (set-up, compilation and the
first collective are not timed), a rank whose newest beat is older than `hang_timeout_s`, while
no rank is busy, means the job hangs: every worker is asked for its stack, the stacks are copied
to `RUN_DIR/stacks/<time>/rank{r}.txt`, and the workers are killed (the launcher then restarts
them, if restarts remain, or ends the job).
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

HEARTBEAT_ENV = "FW_HEARTBEAT_DIR"
WATCHED = "watched"  # in the heartbeat directory while the launcher's watchdog runs
# Not SIGTERM/SIGUSR1 (checkpoint, then stop) nor SIGUSR2 (SLURM's usual preemption warning).
STACK_SIGNAL = signal.SIGRTMIN + 3 if hasattr(signal, "SIGRTMIN") else None

_current: Heartbeat | None = None


class Heartbeat:
    """This rank's beats and busy marks in the launcher's heartbeat directory."""

    def __init__(self, directory: Path, local_rank: int, rank: int) -> None:
        self.beat_file = directory / f"rank{local_rank}"
        self.busy_file = directory / f"busy-rank{local_rank}"
        self.stacks = (directory / f"stacks-rank{rank}.txt").open("w")  # named as in the run dir
        if STACK_SIGNAL is not None:
            faulthandler.register(STACK_SIGNAL, file=self.stacks, all_threads=True)

    def beat(self) -> None:
        self.beat_file.touch()

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        self.busy_file.touch()
        try:
            yield
        finally:
            self.busy_file.unlink(missing_ok=True)
            self.beat()


def start_beating(local_rank: int, rank: int):
    """The Lightning callback that beats for this rank, when the launcher watches (else None)."""
    global _current
    directory = os.environ.get(HEARTBEAT_ENV)
    if not directory:
        return None
    (Path(directory) / f"pid-rank{local_rank}").write_text(str(os.getpid()))  # for ExitWatch
    if not (Path(directory) / WATCHED).exists():  # hang_timeout_s=0: no per-step beat
        return None
    import lightning.pytorch as pl

    _current = heart = Heartbeat(Path(directory), local_rank, rank)

    class Beat(pl.Callback):
        def on_train_batch_end(self, *args) -> None:
            heart.beat()

        def on_validation_batch_end(self, *args) -> None:
            heart.beat()

        def on_train_end(self, *args) -> None:
            heart.busy_file.touch()  # what follows training (sampling, export) is not timed

    return Beat()


def busy() -> contextlib.AbstractContextManager:
    """Around a checkpoint save or load: the watchdog waits for it, however long it takes."""
    return _current.busy() if _current is not None else contextlib.nullcontext()


class Watchdog(threading.Thread):
    """Watches the beats of the `world_size` ranks on this machine (by local rank); kills the
    workers once when the job hangs."""

    def __init__(
        self,
        directory: Path,
        world_size: int,
        timeout: float,
        run_dir: Path,
        workers: Callable[[], list[int]],
    ) -> None:
        super().__init__(name="fw-watchdog", daemon=True)
        self.directory, self.world_size, self.timeout = directory, world_size, timeout
        self.run_dir, self.workers = run_dir, workers
        self.fired: str | None = None  # what the watchdog saw, once it killed the job
        self._halt = threading.Event()

    def stop(self) -> None:
        self._halt.set()
        self.join()

    def run(self) -> None:
        period = min(1.0, self.timeout / 10)
        since: float | None = None  # armed (first beat seen), or last seen busy
        while not self._halt.wait(period):
            now = time.time()
            if self._busy():
                since = now
                continue
            beats = {r: self._beat(r) for r in range(self.world_size)}
            if all(t is None for t in beats.values()):
                continue  # not armed before the first beat
            since = since or now
            stale = {r: now - max(t or 0.0, since) for r, t in beats.items()}
            if max(stale.values()) > self.timeout:
                self._fire(stale)
                return

    def _beat(self, rank: int) -> float | None:
        try:
            return (self.directory / f"rank{rank}").stat().st_mtime
        except FileNotFoundError:
            return None

    def _busy(self) -> bool:
        """Whether a rank saves or loads a checkpoint (or has ended training)."""
        return any(self.directory.glob("busy-rank*"))

    def _stack_files(self) -> list[Path]:
        """The ranks' stack dumps, named by global rank."""
        return sorted(self.directory.glob("stacks-rank*.txt"))

    def _fire(self, stale: dict[int, float]) -> None:
        pids = self.workers()
        if STACK_SIGNAL is not None:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, STACK_SIGNAL)
            time.sleep(2.0)  # the dumps are written by each worker's faulthandler
        from framework import files

        target = files.make_dir(self.run_dir / "stacks" / time.strftime("%Y-%m-%d_%H-%M-%S"))
        for source in self._stack_files():  # 0640, whatever the umask, as the run's files
            files.write_atomic(target / source.name.removeprefix("stacks-"), source.read_bytes())
        slow = ", ".join(f"rank {r}: {s:.0f} s" for r, s in sorted(stale.items()))
        self.fired = (
            f"the job hung: no training progress within launcher.hang_timeout_s="
            f"{self.timeout:g} ({slow}); every rank's Python stack is in {target}"
        )
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


class ExitWatch(threading.Thread):
    """Records how each worker ended (exit code or signal, and when), read from the kernel the
    moment it ends, without reaping it.

    The elastic agent reports only the first failed rank it finds when it next looks, which is
    often a rank that raised because another one was killed; a rank killed by a signal leaves no
    error file. The workers write their pids (`pid-rank{r}`) into the heartbeat directory.
    """

    def __init__(self, directory: Path, world_size: int) -> None:
        super().__init__(name="fw-exit-watch", daemon=True)
        self.directory, self.world_size = directory, world_size
        self.ended: dict[int, tuple[float, str]] = {}  # rank: (time, how), failures only
        self._halt = threading.Event()

    def stop(self) -> None:
        self._halt.set()

    def run(self) -> None:
        watched: set[int] = set()
        while len(watched) < self.world_size and not self._halt.wait(0.05):
            for rank in range(self.world_size):
                path = self.directory / f"pid-rank{rank}"
                if rank in watched or not path.exists():
                    continue
                with contextlib.suppress(OSError, ValueError):
                    pid = int(path.read_text())
                    threading.Thread(target=self._wait, args=(rank, pid), daemon=True).start()
                    watched.add(rank)

    def _wait(self, rank: int, pid: int) -> None:
        try:  # WNOWAIT leaves the exit status to the agent, which reaps its workers
            info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
        except (ChildProcessError, OSError):
            return  # already reaped, or not our child
        if info is None:
            return
        if info.si_code in (os.CLD_KILLED, os.CLD_DUMPED):
            how = f"killed by signal {signal.Signals(info.si_status).name}"
        elif info.si_status != 0:
            how = f"exit code {info.si_status}"
        else:
            return
        self.ended[rank] = (time.time(), how)


def nccl_settings(run_dir: Path) -> dict[str, str]:
    """NCCL's variables for a job on CUDA (a value the user set wins): a failed or timed-out
    collective ends the process instead of hanging it, and each rank keeps a record of its last
    collectives (the flight recorder), written to RUN_DIR/stacks/nccl_trace_rank_<r> when one
    times out."""
    return {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": str(run_dir / "stacks" / "nccl_trace_rank_"),
    }
