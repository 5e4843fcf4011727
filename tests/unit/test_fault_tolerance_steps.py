"""A replica group's step bookkeeping when torchft does not commit a step (a group died during
it), run in this process: `fw train` of one group whose torchft Manager is replaced by a fake
that drops one chosen step. (Real groups, killed and healed: tests/distributed/
test_fault_tolerance.py.)"""

from __future__ import annotations

import logging
import math
import socket
import types

import pytest
import torchft  # noqa: F401 (the torchft extra: missing, these fail, not skip)

from tests.conftest import QUIET, read_metrics

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


class PeerGroupManager(OneGroupManager):
    """A Manager whose quorum has a second, live group: records the norm of each buffer the
    strategy hands its all-reduce; at `overflow` the average carries the other group's fp16
    overflow (an inf); at the quorum of `heal` the other group's state arrives (this group's
    own, its loss scale at `peer_scale`: the peer's scaler has moved on)."""

    def __init__(self, drop: int, overflow: int, heal: int, peer_scale: float) -> None:
        super().__init__(drop)
        self.overflow, self.heal, self.peer_scale = overflow, heal, peer_scale
        self.handed: list[float] = []
        self.strategy = None

    def start_quorum(self) -> None:
        super().start_quorum()
        if self.step == self.heal and self.strategy is not None:
            state = self.strategy._state()
            state["scaler"]["scale"] = self.peer_scale
            self.strategy._load_state(state)
            self.heal = -1

    def allreduce(self, tensor):
        self.handed.append(float(tensor.norm()))
        if self.step == self.overflow:
            tensor[0] = float("inf")
        return super().allreduce(tensor)

    def num_participants(self) -> int:
        return 2


def test_groups_under_16_mixed_average_unscaled_gradients_and_agree_on_overflows(
    tmp_path, monkeypatch, lighthouse
):
    """A replica group under fp16 with a loss scaler (Lightning's MixedPrecision around
    torch.amp.GradScaler("cpu"), tests.tasks.CpuGradScaler): torchft averages the unscaled
    gradients (groups' scales differ after a heal: scaled ones would mix units); another
    group's overflow in the average makes this group's scaler skip the step too (else the
    optimizer applies an inf); a dropped step leaves the scaler ready for the next; a heal
    brings the peer's loss scale."""
    import json

    from framework.cli import main
    from framework.strategies.ddp import replica_groups

    manager = PeerGroupManager(drop=2, overflow=4, heal=6, peer_scale=1024.0)

    def start(strategy):
        manager.strategy = strategy
        return manager

    monkeypatch.setattr(replica_groups.ReplicaSteps, "_start_manager", start)
    monkeypatch.chdir(tmp_path)
    args = [
        "task=digits",
        "trainer.max_steps=8",
        "trainer.limit_val_batches=0",
        "strategy=ddp",
        "strategy.fault_tolerance=torchft",
        f"strategy.lighthouse={lighthouse}",
        "+callbacks.fp16._target_=tests.tasks.CpuGradScaler",
        *QUIET,
        "run.dir=run",
    ]
    assert main(["train", *args]) == 0
    seen = json.loads((tmp_path / "run" / "scales-rank0.json").read_text())
    scales = {step: (before, after) for step, before, after in seen["scales"]}
    assert len(manager.handed) == 9  # 8 steps and the dropped try, whose callbacks never ran
    committed = manager.handed[:2] + manager.handed[3:]
    for handed, applied in zip(committed, seen["grad_norms"], strict=True):
        if math.isfinite(applied):  # the overflowed step aside
            assert handed == pytest.approx(applied, rel=1e-5), "scaled gradients were averaged"
    assert scales[4][1] == scales[4][0] / 2, "the other group's overflow: this scaler skipped too"
    assert seen["weights_finite"], "an overflowed average was applied"
    assert scales[6][0] == 1024.0, "the heal brought the peer's loss scale"
    assert manager.step == 8
