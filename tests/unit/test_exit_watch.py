"""How a job's failure is reported: a worker killed by a signal is named, and first, even when
the agent only saw the rank that raised because of it."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from types import SimpleNamespace

from framework.launch.outcomes import describe_failures
from framework.watchdog import ExitWatch


def child(directory: Path, rank: int, code: int | None) -> int:
    """A forked worker that writes its pid, then exits with `code` (None: waits to be killed)."""
    pid = os.fork()
    if pid == 0:
        (directory / f"pid-rank{rank}").write_text(str(os.getpid()))
        if code is None:
            time.sleep(60)
        os._exit(code or 0)
    return pid


def test_exit_watch_records_a_killed_worker_and_leaves_its_status_to_the_agent(tmp_path):
    watch = ExitWatch(tmp_path, world_size=2)
    watch.start()
    killed, finished = child(tmp_path, 0, None), child(tmp_path, 1, 0)
    while not (tmp_path / "pid-rank0").exists():
        time.sleep(0.01)
    time.sleep(0.2)  # the watch found both pids
    os.kill(killed, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while 0 not in watch.ended and time.monotonic() < deadline:
        time.sleep(0.01)
    watch.stop()
    assert watch.ended[0][1] == "killed by signal SIGKILL"
    # the agent still reaps both workers and reads the same statuses
    assert os.waitpid(killed, 0)[1] == signal.SIGKILL
    assert os.waitpid(finished, 0)[1] == 0
    assert 1 not in watch.ended, "a worker that finished is no failure"


def test_the_killed_rank_comes_first_and_ranks_stopped_later_are_left_out(tmp_path):
    error = tmp_path / "attempt_0" / "0" / "error.json"
    error.parent.mkdir(parents=True)
    message = {"message": "RuntimeError: Connection closed by peer"}
    error.write_text(json.dumps({"message": message}))
    raised = error.stat().st_mtime
    agent_saw = SimpleNamespace(failures={})  # the agent's report: rank 0's exception only
    ended = {1: (raised - 0.5, "killed by signal SIGKILL"), 2: (raised + 1.0, "exit code 1")}
    lines = describe_failures(agent_saw, tmp_path, ended).splitlines()
    assert lines == [
        "rank 1 failed: no Python exception recorded (killed by signal SIGKILL)",
        "rank 0 failed: RuntimeError: Connection closed by peer",
    ]
