"""Context-parallel attention (framework/parallel/context/attention.py) against attention over the
whole sequence: each mode's outputs and input gradients, causal and not, with the zigzag split,
including a sequence of exactly 2 x cp positions; the loss (context.cross_entropy) with ignored
targets spread unevenly over the chunks against the whole sequences' mean; ring and allgather
with grouped-query K/V (fewer heads, sent unrepeated) on each block kernel; real gloo
collectives between processes started by torch's multiprocessing spawn."""

from __future__ import annotations

import json
import os

import pytest
import torch

from framework.parallel import context

# the modes, and ring and allgather on the plain-operations kernel (a device without a fused
# one: fp64 on CUDA)
MODES = (*context.MODES, "ring-math", "allgather-math")
CASES = [  # (mode, causal, sequence length as a multiple of 2 x cp)
    (mode, causal, chunks) for mode in MODES for causal in (True, False) for chunks in (1, 4)
]


def compare(rank: int, cp: int, store: str, out: str) -> None:
    """Rank `rank` of `cp`: every case's largest differences from one process's attention."""
    import torch.distributed as dist
    import torch.nn.functional as F

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=cp)
    group = dist.group.WORLD
    errors = {}
    for mode, causal, chunks in CASES:
        length = 2 * cp * chunks
        gen = torch.Generator().manual_seed(length + causal)
        shape = (2, 4, length, 8)  # (batch, heads, positions, head_dim)
        q, k, v, weight = (torch.randn(shape, generator=gen, dtype=torch.float64) for _ in "qkvw")
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        want = F.scaled_dot_product_attention(*full, is_causal=causal)
        (want * weight).sum().backward()
        plan = context.ContextPlan(mode, group, cp, rank, active=True)  # mode: a known one
        index = context.zigzag_index(length, cp, rank)

        def split(t, index=index):  # this rank's positions (dim 2 here)
            return t.index_select(2, index)

        mine = [split(t).detach().requires_grad_() for t in (q, k, v)]
        if mode.endswith("-math"):
            args = (causal, mode.split("-")[0], group, cp, rank, "math")
            got = context.split_attention(*mine, *args)
        else:
            got = plan.attention(*mine, causal=causal)
        (got * split(weight)).sum().backward()
        diffs = [(got - split(want)).abs().max().item()]
        diffs += [
            (m.grad - split(f.grad)).abs().max().item() for m, f in zip(mine, full, strict=True)
        ]
        errors[f"{mode} causal={causal} length={length}"] = max(diffs)
    errors.update(loss_errors(rank, cp, group))
    errors.update(grouped_query_errors(rank, cp, group))
    with open(f"{out}.{rank}", "w") as f:
        json.dump(errors, f)
    dist.destroy_process_group()


def grouped_query_errors(rank: int, cp: int, group) -> dict[str, float]:
    """Ring and allgather with 4 query heads sharing 2 key/value heads, on each block kernel
    (the CUDA ones emulated on the CPU: tests/unit/test_context_kernels.py), against
    F.scaled_dot_product_attention(enable_gqa=True) over the whole sequence; and how many heads
    beyond the model's 2 the ring's exchanges carried (must be none: K/V travel unrepeated)."""
    import torch.nn.functional as F

    from framework.parallel.context import attention, kernels
    from tests.unit.test_context_kernels import EmulatedCudaOps

    kernels.aten = EmulatedCudaOps()
    sent: list[int] = []  # the head count of every block the ring passed on (dim 2)
    exchange = attention.exchange

    def recorded(x, *args):
        sent.append(x.shape[2])
        return exchange(x, *args)

    attention.exchange = recorded
    errors = {}
    length, kv_heads = 4 * cp, 2
    for mode in ("ring", "allgather"):
        for kernel in kernels.KERNELS:
            for causal in (True, False):
                gen = torch.Generator().manual_seed(7 + causal)
                q, weight = (
                    torch.randn(2, 4, length, 8, generator=gen, dtype=torch.float64) for _ in "qw"
                )
                k, v = (
                    torch.randn(2, kv_heads, length, 8, generator=gen, dtype=torch.float64)
                    for _ in "kv"
                )
                full = [t.clone().requires_grad_() for t in (q, k, v)]
                want = F.scaled_dot_product_attention(*full, is_causal=causal, enable_gqa=True)
                (want * weight).sum().backward()
                index = context.zigzag_index(length, cp, rank)
                mine = [t.index_select(2, index).detach().requires_grad_() for t in (q, k, v)]
                got = context.split_attention(*mine, causal, mode, group, cp, rank, kernel)
                (got * weight.index_select(2, index)).sum().backward()
                diffs = [(got - want.index_select(2, index)).abs().max().item()]
                diffs += [
                    (m.grad - f.grad.index_select(2, index)).abs().max().item()
                    for m, f in zip(mine, full, strict=True)
                ]
                errors[f"grouped-query {mode} {kernel} causal={causal}"] = max(diffs)
    attention.exchange = exchange
    errors["heads sent beyond the model's K/V heads"] = float(max(sent) - kv_heads)
    return errors


def loss_errors(rank: int, cp: int, group) -> dict[str, float]:
    """context.cross_entropy on this rank's chunks, with ignored targets more frequent in some
    chunks than others: the mean over the ranks of its values against the whole sequences'
    F.cross_entropy, and its logits' gradients (over cp: FSDP averages over the cp ranks)
    against the whole loss's; also how far a mean of per-chunk means lands (must be far)."""
    import torch.distributed as dist
    import torch.nn.functional as F

    length, classes = 8 * cp, 5
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(2, length, classes, generator=gen, dtype=torch.float64)
    targets = torch.randint(0, classes, (2, length), generator=gen)
    targets[torch.rand(2, length, generator=gen) < 0.3] = -100
    targets[:, : 3 * length // 8] = -100  # the first chunks' ranks lose more
    full = logits.clone().requires_grad_()
    want = F.cross_entropy(full.reshape(-1, classes), targets.reshape(-1))
    want.backward()
    outside = context.cross_entropy(logits, targets)  # no plan in force: F.cross_entropy
    index = context.zigzag_index(length, cp, rank)
    mine = logits.index_select(1, index).requires_grad_()
    plan = context.ContextPlan("ring", group, cp, rank)
    with context.running(plan):
        got = context.cross_entropy(mine, targets.index_select(1, index))
    got.backward()
    per_chunk = F.cross_entropy(
        mine.detach().reshape(-1, classes), targets.index_select(1, index).reshape(-1)
    )
    means = torch.stack([got.detach(), per_chunk])
    dist.all_reduce(means, group=group)
    means /= cp
    return {
        "loss": abs(means[0].item() - want.item()),
        "loss gradient": (mine.grad / cp - full.grad.index_select(1, index)).abs().max().item(),
        "loss outside a cp step": (outside - want).abs().item(),
        "mean of chunk means (far)": abs(means[1].item() - want.item()),
    }


def run(cp: int, tmp_path) -> dict[str, float]:
    import torch.multiprocessing as mp

    out = str(tmp_path / "errors")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(compare, args=(cp, str(tmp_path / "store"), out), nprocs=cp)
    worst: dict[str, float] = {}
    for rank in range(cp):
        with open(f"{out}.{rank}") as f:
            for case, err in json.load(f).items():
                worst[case] = max(worst.get(case, err), err)
    return worst


@pytest.mark.parametrize("cp", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_every_mode_and_the_loss_match_whole_sequences(cp, tmp_path):
    worst = run(cp, tmp_path)
    assert len(worst) == len(CASES) + 4 + 2 * 4 * 2 + 1
    far = worst.pop("mean of chunk means (far)")  # the ignored targets make it matter
    assert far > 1e-2, far
    bad = {case: err for case, err in worst.items() if not err <= 1e-6}
    assert not bad, bad


def test_zigzag_split_pairs_head_and_tail_chunks():
    # cp=2, 8 positions: chunks of 2; rank 0 keeps chunks 0 and 3, rank 1 chunks 1 and 2
    assert context.zigzag_index(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert context.zigzag_index(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert sorted(context.zigzag_order(12, 3).tolist()) == list(range(12))
    with pytest.raises(ValueError, match="2 x cp = 4"):
        context.zigzag_index(6, 2, 0)
