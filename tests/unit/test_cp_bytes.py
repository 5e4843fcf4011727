"""Context parallel's K/V traffic: the bytes `fw plan` reports per layer per step
(framework/preflight/traffic.py, `context_bytes`) are the issue's formulas, and they are what the
context-parallel attention actually hands its collectives, counted by wrapping them (one rank of
a fake process group, fake tensors: in this process, no data moves)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from framework.nn import context
from framework.preflight.fakes import fake_mode, fake_world
from framework.preflight.traffic import context_bytes

B, S, H, D = 2, 32, 4, 8  # rows, sequence, query heads, head_dim


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("element", [2, 4])
def test_forward_bytes_are_the_formulas(cp, element):
    kv = 2  # key/value heads
    ring = (cp - 1) * 2 * B * S // cp * kv * D * element  # per direction
    assert context_bytes("ring", cp, B, S, H, kv, D, element)[0] == ring
    assert context_bytes("allgather", cp, B, S, H, kv, D, element)[0] == ring  # once
    all_to_all = B * S * H * D // cp * element  # each of the 4, (cp-1)/cp of it leaving
    assert (
        context_bytes("ulysses", cp, B, S, H, kv, D, element)[0] == 4 * all_to_all * (cp - 1) / cp
    )
    assert context_bytes("ring", 1, B, S, H, kv, D, element) == (0.0, 0.0)


class Sent:
    """Wraps the collectives framework.nn.context calls and adds up the bytes that leave this
    rank: a send whole, an all-gather's input to cp-1 others, (cp-1)/cp of a reduce-scatter's
    or an all-to-all's input."""

    def __init__(self, monkeypatch, cp: int) -> None:
        self.bytes = 0.0
        share = {"all_gather_single": cp - 1, "reduce_scatter_single": (cp - 1) / cp}
        share |= {"all_to_all_single": (cp - 1) / cp, "isend": 1}
        for name, factor in share.items():
            monkeypatch.setattr(dist, name, self.counted(getattr(dist, name), factor))

    def counted(self, collective, factor):
        def call(*args, **kwargs):
            sent = args[0] if collective.__name__ == "isend" else args[1]
            self.bytes += sent.numel() * sent.element_size() * factor
            return collective(*args, **kwargs)

        return call


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize(
    ("mode", "kv", "dtype"),
    [
        ("ring", 2, torch.float32),
        ("ring", 4, torch.bfloat16),
        ("allgather", 2, torch.float32),
        ("ulysses", 4, torch.float32),
    ],
)
def test_attention_sends_what_the_plan_reports(monkeypatch, cp, mode, kv, dtype):
    """One layer's forward and backward on rank 1 of cp; grouped-query K/V (kv < heads) travel
    with their own heads."""
    with fake_world(1, cp), fake_mode():
        sent = Sent(monkeypatch, cp)
        plan = context.ContextPlan(mode, dist.group.WORLD, cp, 1, active=True)
        local = S // cp
        q = torch.randn(B, H, local, D, dtype=dtype, requires_grad=True)
        k, v = (torch.randn(B, kv, local, D, dtype=dtype, requires_grad=True) for _ in "kv")
        out = plan.attention(q, k, v, causal=True)
        forward = sent.bytes
        out.sum().backward()
        backward = sent.bytes - forward
    element = torch.finfo(dtype).bits // 8
    assert (forward, backward) == context_bytes(mode, cp, B, S, H, kv, D, element)


def test_fw_plan_counts_the_kv_bytes_of_every_layer():
    """The bytes column of `fw plan` (traffic.traffic) holds every layer's K/V bytes: gpt, 2
    layers, 4 heads of 16, 4 sequences of 64 positions, fp32, ring over cp=2."""
    from framework.preflight.check import check
    from framework.preflight.traffic import traffic

    gpt = ["task=gpt", "task.model.n_layer=2", "task.model.n_embd=64", "task.model.n_head=4"]
    shape = ["task.model.block_size=64", "task.data.batch_size=4", "task.data.max_bytes=20000"]
    report = check(
        [*gpt, *shape, "trainer.devices=2", "strategy=fsdp", "strategy.cp=2"], ranks=[0], quick=True
    )
    block = 2 * 4 * 32 * 4 * 16 * 4  # one rank's K and V, bytes
    assert traffic(report.config, report)["context"] == 2 * (block + 3 * block)
