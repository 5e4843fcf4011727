"""What a replica group that rejoins receives from a peer (`strategy.fault_tolerance=torchft`):
the heal state is read as data, a state that names code is refused before it runs, and the
state is served on one address. (A real heal between groups: tests/distributed/
test_fault_tolerance.py.)"""

from __future__ import annotations

import types
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torchft  # noqa: F401 (the torchft extra: missing, these fail, not skip)

from framework.checkpoint.safe import UnsafeCheckpoint
from framework.replica_groups.heal import HealTransport

TIMEOUT = timedelta(seconds=20)
STEP = 7


class TouchesMarker:
    """Unpickled, it creates `marker`: what a forged heal state could run instead."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


@pytest.fixture
def transports():
    """A peer serving a heal state and the group receiving it, both on loopback."""
    made: list[HealTransport] = []

    def make() -> HealTransport:
        made.append(HealTransport(TIMEOUT, "127.0.0.1"))
        return made[-1]

    yield make
    for transport in made:
        transport.shutdown(wait=True)


def heal(transports, state):
    """`state` served by one transport (as torchft's Manager hands it) and received by another."""
    peer, joining = transports(), transports()
    peer.send_checkpoint([1], STEP, state, TIMEOUT)
    return joining.recv_checkpoint(0, peer.metadata(), STEP, TIMEOUT)


def test_a_heal_state_that_names_code_is_refused_and_nothing_runs(transports, tmp_path):
    marker = tmp_path / "ran"
    state = {"user": {"default": {"model": {"w": torch.ones(2)}}}, "evil": TouchesMarker(marker)}
    with pytest.raises(UnsafeCheckpoint, match="heal state from http://127.0.0.1:.* names"):
        heal(transports, state)
    assert not marker.exists(), "the pickled callable ran while the heal state was read"


def test_the_model_optimizer_scheduler_and_scaler_states_arrive_whole(transports):
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5)
    scaler = {"scale": 1024.0, "growth_factor": 2.0, "_growth_tracker": 3}
    own = {"model": model.state_dict(), "optimizers": [optimizer.state_dict()]}
    state = {
        "user": {"default": {**own, "schedulers": [scheduler.state_dict()], "scaler": scaler}},
        "torchft": {"step": STEP, "batches_committed": 14},
    }
    got = heal(transports, state)
    assert got["torchft"] == state["torchft"]
    user = got["user"]["default"]
    for name, tensor in model.state_dict().items():
        assert torch.equal(user["model"][name], tensor), name
    sent = optimizer.state_dict()
    assert user["optimizers"][0]["param_groups"] == sent["param_groups"]
    for index, moments in sent["state"].items():
        for key, value in moments.items():
            assert torch.equal(user["optimizers"][0]["state"][index][key], value), key
    assert user["schedulers"] == [scheduler.state_dict()]
    assert user["scaler"] == scaler


def test_the_heal_server_listens_on_the_address_given_only(transports):
    transport = transports()
    assert transport._server.socket.getsockname()[0] == "127.0.0.1"
    assert transport.metadata().startswith("http://127.0.0.1:")


def test_the_replica_groups_manager_heals_through_the_restricted_transport(monkeypatch):
    import torchft as ft

    from framework.replica_groups.steps import ReplicaSteps

    made = {}
    monkeypatch.setattr(ft, "Manager", lambda **kwargs: made.update(kwargs))
    cfg = types.SimpleNamespace(
        fault_timeout_s=20,
        min_replicas=1,
        lighthouse="127.0.0.1:1",
        replica_group=0,
        replica_groups=1,
    )
    strategy = types.SimpleNamespace(
        cfg=cfg,
        _group_store=lambda: ("127.0.0.1", 1),
        root_device=torch.device("cpu"),
        global_rank=0,
        world_size=1,
        _load_state=None,
        _state=None,
    )
    ReplicaSteps._start_manager(strategy)
    transport = made["checkpoint_transport"]
    try:
        assert isinstance(transport, HealTransport)
    finally:
        transport.shutdown(wait=True)
