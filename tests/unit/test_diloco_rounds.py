"""DiLoCo's outer loop on one process (`framework.strategies.diloco.rounds`): when rounds end, the
outer step itself, streaming fragments, bf16 pseudo-gradients and the bytes they count.

The multi-process behaviour (averaging, checkpoints, moves) is tested through `fw` in
tests/distributed/test_diloco.py."""

from __future__ import annotations

from copy import deepcopy as copy_of

import pytest
import torch

from framework.strategies.diloco import Config, OuterOptimizer
from framework.strategies.diloco.rounds import Rounds, split


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))


def inner_step(net: torch.nn.Module, rounds: Rounds, lr: float = 0.1) -> dict[str, float]:
    """One plain SGD step on a fixed batch, then the rounds' bookkeeping."""
    net.zero_grad()
    (net(torch.ones(3, 4)) - 1).square().mean().backward()
    with torch.no_grad():
        for p in net.parameters():
            p -= lr * p.grad
    return rounds.after_inner_step()


def test_the_outer_step_is_sgd_on_the_pseudo_gradient_once_per_round():
    net = model()
    start = [p.detach().clone() for p in net.parameters()]
    rounds = Rounds(Config(sync_every=3), net)
    logged = [inner_step(net, rounds) for _ in range(3)]
    assert ["diloco/pseudo_grad_norm" in m for m in logged] == [False, False, True]
    assert rounds.synced()
    # what the outer optimizer makes of it, by hand: Nesterov SGD's first step from `start`
    expected = [p.detach().clone() for p in start]
    outer = torch.optim.SGD(expected, lr=0.7, momentum=0.9, nesterov=True)
    torch.manual_seed(0)
    local = model()
    for _ in range(3):
        local.zero_grad()
        (local(torch.ones(3, 4)) - 1).square().mean().backward()
        with torch.no_grad():
            for p in local.parameters():
                p -= 0.1 * p.grad
    for e, s, p in zip(expected, start, local.parameters(), strict=True):
        e.grad = s - p.detach()
    outer.step()
    for got, want in zip(net.parameters(), expected, strict=True):
        assert torch.equal(got, want)


def test_outer_sgd_with_lr_1_and_no_momentum_keeps_the_local_result():
    """localsgd: on one process the average of one replica is the replica itself."""
    net, reference = model(), model()
    plain = OuterOptimizer(lr=1.0, momentum=0.0, nesterov=False)
    rounds = Rounds(Config(sync_every=2, outer_optimizer=plain), net)
    unsynced = Rounds(Config(sync_every=1000), reference)
    for _ in range(4):
        inner_step(net, rounds)
        inner_step(reference, unsynced)
    for a, b in zip(net.parameters(), reference.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-7)


def test_streaming_fragments_sync_at_staggered_steps():
    net = model()
    rounds = Rounds(Config(sync_every=4, fragments=2), net)
    assert rounds.offsets == [0, 2]
    assert rounds.fragments == [[0], [1, 2, 3]]  # 32 elements | 8 + 16 + 2
    synced_at = [s + 1 for s in range(8) if "diloco/pseudo_grad_norm" in inner_step(net, rounds)]
    assert synced_at == [2, 4, 6, 8]  # fragment 1 at 2 and 6, fragment 0 at 4 and 8
    assert not rounds.synced(), "with fragments some part is always mid-round"


def test_bf16_pseudo_gradients_halve_the_bytes():
    fp32, bf16 = model(), model()
    a = Rounds(Config(sync_every=4), fp32)
    b = Rounds(Config(sync_every=4, pseudo_grad_dtype="bf16"), bf16)
    numel = sum(p.numel() for p in fp32.parameters())
    first = inner_step(fp32, a)
    assert first["comm/bytes_per_step"] == numel * 4 / 4
    assert first["comm/ddp_bytes_per_step"] == numel * 4
    assert inner_step(bf16, b)["comm/bytes_per_step"] == numel * 2 / 4
    for _ in range(3):
        inner_step(fp32, a), inner_step(bf16, b)
    for x, y in zip(fp32.parameters(), bf16.parameters(), strict=True):
        assert torch.allclose(x, y, atol=1e-2) and not torch.equal(x, y), "rounded, close"


def test_a_saved_round_continues_where_it_stopped():
    net, copy = model(), model()
    rounds = Rounds(Config(sync_every=3), net)
    for _ in range(4):
        inner_step(net, rounds)
    state, outer = copy_of(rounds.state_dict()), copy_of(rounds.outer_by_name())  # as saved
    copy.load_state_dict(net.state_dict())
    resumed = Rounds(Config(sync_every=3), copy)
    resumed.load_state_dict(state, outer)
    for _ in range(5):
        inner_step(net, rounds), inner_step(copy, resumed)
    for x, y in zip(net.parameters(), copy.parameters(), strict=True):
        assert torch.equal(x, y)


@pytest.mark.parametrize(("sizes", "count"), [([10, 10, 10, 10], 2), ([100, 1, 1], 3)])
def test_fragments_are_runs_of_parameters_in_order(sizes, count):
    parts = split([torch.empty(n) for n in sizes], count)
    assert len(parts) == count and sum(parts, []) == list(range(len(sizes)))
