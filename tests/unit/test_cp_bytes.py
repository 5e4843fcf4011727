"""Context parallel's K/V traffic: the bytes `fw plan` reports per layer per step
(framework/preflight/traffic.py, `context_bytes`) are the issue's formulas, and they are what the
context-parallel attention actually hands its collectives, counted by wrapping them (one rank of
a fake process group, fake tensors: in this process, no data moves)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from framework.parallel import context
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
    """Wraps the collectives framework.parallel.context calls and adds up the bytes that leave this
    rank: a send whole, an all-gather's input to cp-1 others, (cp-1)/cp of a reduce-scatter's
    or an all-to-all's input."""

    def __init__(self, monkeypatch, cp: int) -> None:
        self.bytes = 0.0
        share = {"all_gather_single": cp - 1, "reduce_scatter_single": (cp - 1) / cp}
        share |= {"all_to_all_single": (cp - 1) / cp}
        for name, factor in share.items():
            monkeypatch.setattr(dist, name, self.counted(getattr(dist, name), factor))
        monkeypatch.setattr(dist, "batch_isend_irecv", self.batched(dist.batch_isend_irecv))

    def counted(self, collective, factor):
        def call(*args, **kwargs):
            sent = args[1]
            self.bytes += sent.numel() * sent.element_size() * factor
            return collective(*args, **kwargs)

        return call

    def batched(self, batch):
        """The ring's sends, issued with their receives in one batch: each send whole."""

        def call(ops):
            for op in ops:
                if op.op is dist.isend:
                    self.bytes += op.tensor.numel() * op.tensor.element_size()
            return batch(ops)

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


@pytest.mark.parametrize("mode", ["ring", "allgather", "ulysses"])
def test_fw_check_and_fw_plan_count_the_kv_bytes_of_every_layer(mode):
    """The sent column of `fw check` and the bytes of `fw plan` (traffic.traffic) hold every
    layer's K/V bytes per step, forward and backward as the mode sends them: gpt, 2 layers, 4
    heads of 16, 4 sequences of 64 positions, fp32, cp=2."""
    from framework.preflight.check import check
    from framework.preflight.traffic import traffic

    gpt = ["task=gpt", "task.model.n_layer=2", "task.model.n_embd=64", "task.model.n_head=4"]
    shape = ["task.model.block_size=64", "task.data.batch_size=4", "task.data.max_bytes=20000"]
    cp2 = ["trainer.devices=2", "strategy=fsdp", "strategy.cp=2", f"strategy.cp_mode={mode}"]
    report = check([*gpt, *shape, *cp2], ranks=[0], quick=True)
    cp, b, s, h, d, element = 2, 4, 64, 4, 16, 4  # h: heads, each also a K/V head
    ring = (cp - 1) * 2 * b * s // cp * h * d * element  # per direction, the formula
    block = 2 * b * s // cp * h * d * element  # one rank's K and V
    all_to_all = b * s // cp * h * d * element * (cp - 1) / cp  # the share leaving the rank
    per_layer = {  # (forward, backward)
        "ring": (ring, ring + cp * block),  # backward: K/V and their gradients on, one back
        "allgather": (ring, ring),  # gathered once, their gradients reduce-scattered once
        "ulysses": (4 * all_to_all, 4 * all_to_all),  # q, k, v to heads, the output back
    }[mode]
    kv_bytes = 2 * sum(per_layer)  # 2 layers
    assert report.sent[0]["context"] == kv_bytes
    assert traffic(report.config, report)["context"] == kv_bytes
    table = report.table()
    assert f"Context parallel ({mode}, cp=2): K/V sent per step {kv_bytes / 2**10:.3f} KiB" in table
    lines = table.splitlines()
    head = next(line for line in lines if line.startswith("rank "))
    column = head.index("sent ")
    unit = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[head[column + 5 : column + 8]]
    sent = float(next(line for line in lines if line.startswith("0 "))[column:].split()[0])
    assert sent == pytest.approx((report.sent[0]["data"] + kv_bytes) / unit, abs=1e-3)
