"""Run by torch's launcher with 2 processes (tests/distributed/test_inferred_plans.py): torch's
`nn.MultiheadAttention` split by whole heads (the `multihead_attention` style) against the same
module whole, in fp64, called the ways modules call it: batch first with a causal mask and no
weights (torch's encoder layers); sequence first with a key padding mask and averaged weights;
per-head weights with a per-head mask, other key and value sizes, bias_k/bias_v and a zero
attention position; an unbatched input. Writes, per case, the largest differences of output,
weights and gradients, and whether the state dict holds the module's own names and full values,
to OUT/rank<R>.json."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from framework.parallel.tensor import apply_tensor_parallel

B, L, S, E, H = 3, 5, 6, 32, 4
CAUSAL = nn.Transformer.generate_square_subsequent_mask(L, dtype=torch.float64)
CASES = {
    "encoder_layer": (
        {"batch_first": True},
        lambda m, q, k, v: m(q, q, q, attn_mask=CAUSAL, is_causal=True, need_weights=False),
        (B, L),
        (B, L),
    ),
    "padding_averaged": (
        {},
        lambda m, q, k, v: m(q, k, k, key_padding_mask=PADDING),
        (L, B),
        (S, B),
    ),
    "per_head": (
        {"add_bias_kv": True, "add_zero_attn": True, "kdim": 16, "vdim": 24},
        lambda m, q, k, v: m(
            q, k[..., :16], v[..., :24], attn_mask=PER_HEAD, average_attn_weights=False
        ),
        (L, B),
        (S, B),
    ),
    "unbatched": ({}, lambda m, q, k, v: m(q[:, 0], k[:, 0], k[:, 0]), (L, B), (S, B)),
}
PADDING = torch.zeros(B, S, dtype=torch.bool)
PADDING[1, -2:] = True
PER_HEAD = torch.randn(B * H, L, S, generator=torch.Generator().manual_seed(2)).double()


def module(options):
    torch.manual_seed(0)
    holder = nn.Module()
    holder.attn = nn.MultiheadAttention(E, H, **options).double()
    return holder


def check(name: str, mesh) -> dict[str, float]:
    options, call, q_shape, k_shape = CASES[name]
    g = torch.Generator().manual_seed(1)
    q = torch.randn(*q_shape, E, generator=g, dtype=torch.float64)
    k = torch.randn(*k_shape, E, generator=g, dtype=torch.float64)
    results = []
    for split in (False, True):
        holder = module(options)
        if split:
            apply_tensor_parallel(holder, mesh, {"attn": "multihead_attention"})
        qa, ka = q.clone().requires_grad_(), k.clone().requires_grad_()
        out, weights = call(holder.attn, qa, ka, ka)
        loss = (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum()
        if weights is not None:
            loss = loss + (weights * torch.linspace(1, 2, weights.numel()).view_as(weights)).sum()
        loss.backward()
        grads = {n: full(p.grad) for n, p in holder.named_parameters()}
        state = {n: full(t) for n, t in holder.state_dict().items()}
        results.append((out, weights, qa.grad, ka.grad, grads, state))
    (out0, w0, q0, k0, g0, s0), (out1, w1, q1, k1, g1, s1) = results
    diffs = {
        "output": gap(out0, out1),
        "weights": gap(w0, w1),
        "query_grad": gap(q0, q1),
        "key_grad": gap(k0, k1),
        "param_grads": max(gap(g0[n], g1[n]) for n in g0),
        "state": max(gap(s0[n], s1[n]) for n in s0),
    }
    diffs["same_names"] = float(list(s0) == list(s1) and list(g0) == list(g1))
    return diffs


def gap(a, b) -> float:
    """The largest difference of two tensors (0 when neither exists; inf when one only)."""
    if a is None or b is None:
        return 0.0 if a is b else float("inf")
    return (a - b).abs().max().item()


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def main() -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    result = {name: check(name, mesh["tp"]) for name in CASES}
    with open(f"{sys.argv[1]}/rank{dist.get_rank()}.json", "w") as fh:
        json.dump(result, fh)
    dist.destroy_process_group()
    # written and the group left: skip the interpreter's teardown, which can abort while
    # gloo's threads still hold the groups (see tests/distributed/scripts/moe_layer_check.py)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
