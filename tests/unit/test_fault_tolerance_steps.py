"""A replica group's step bookkeeping when torchft does not commit a step (a group died during
it), run in this process: `fw train` of one group whose torchft Manager is replaced by a fake
that drops one chosen step. (Real groups, killed and healed: tests/distributed/
test_fault_tolerance.py.)"""

from __future__ import annotations

import logging
import socket
import types

import pytest

from tests.conftest import QUIET, read_metrics

pytest.importorskip("torchft")

STEPS = 6
DROPPED = 2
LR = 3e-3  # digits' AdamW lr


class OneGroupManager:
    """torchft's Manager as the strategy drives it, for a group alone in its quorum: every step
    commits but the first try of `drop`."""

    def __init__(self, drop: int) -> None:
        self.step, self.drop, self.tries = 0, drop, 0

    def start_quorum(self) -> None:
        self.tries += 1

    def current_step(self) -> int:
        return self.step

    def allreduce(self, tensor):
        return types.SimpleNamespace(wait=lambda: tensor)

    def num_participants(self) -> int:
        return 1

    def should_commit(self) -> bool:
        if self.step == self.drop:
            self.drop = -1
            return False
        self.step += 1
        return True

    def load_state_dict(self, state) -> None:
        self.step = state["step"]

    def shutdown(self, wait: bool = True) -> None:
        pass


@pytest.fixture
def lighthouse():
    """Something listening where `fw train` checks for the lighthouse before launch."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield f"127.0.0.1:{s.getsockname()[1]}"


class Recorded(logging.Handler):
    """The framework's log lines, whatever stream its handler was opened on (an earlier
    in-process run in this pytest process may have set it up on a stream since closed)."""

    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def test_a_dropped_step_is_trained_again_at_its_step_with_its_lr(tmp_path, monkeypatch, lighthouse):
    from framework.cli import main
    from framework.strategies.ddp import replica_groups

    manager = OneGroupManager(drop=DROPPED)
    monkeypatch.setattr(replica_groups.ReplicaSteps, "_start_manager", lambda self: manager)
    monkeypatch.chdir(tmp_path)
    args = [
        "task=digits",
        "task.scheduler.name=linear",  # an lr that changes every step
        f"trainer.max_steps={STEPS}",
        "trainer.log_every_n_steps=1",
        "trainer.limit_val_batches=0",
        "logger=[csv]",
        "strategy=ddp",
        "strategy.fault_tolerance=torchft",
        f"strategy.lighthouse={lighthouse}",
        *QUIET,
        "run.dir=run",
    ]
    recorded = Recorded()
    logging.getLogger("framework").addHandler(recorded)
    try:
        assert main(["train", *args]) == 0
    finally:
        logging.getLogger("framework").removeHandler(recorded)
    assert any(f"torchft: step {DROPPED} not committed" in line for line in recorded.lines)
    assert manager.tries == STEPS + 1 and manager.step == STEPS, "one batch more, same steps"
    rows = read_metrics(tmp_path / "run")
    assert [int(r["step"]) for r in rows] == list(range(STEPS)), "each step logged once"
    for r in rows:  # the linear schedule's lr at that step: the dropped try did not advance it
        step = int(r["step"])
        assert float(r["lr-AdamW"]) == pytest.approx(LR * (1 - 0.9 * step / STEPS)), r
