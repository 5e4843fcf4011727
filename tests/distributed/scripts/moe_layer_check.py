"""Run by torch's launcher with 2 processes (tests/distributed/test_moe.py): one MoE layer with
its experts split over the 2 ranks against the same layer whole in one process, in fp64 (loop
GEMMs) and fp32 (grouped GEMMs), with a routing in which rank 0 sends no token to rank 1.
Writes the largest differences of outputs and gradients to OUT/rank<R>.json."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from framework.nn.moe import MoE
from framework.parallel.experts import apply_expert_parallel

TOKENS, DIM, HIDDEN, EXPERTS = 12, 16, 32, 4


def layer(dtype, gemm):
    torch.manual_seed(0)
    moe = MoE(DIM, HIDDEN, num_experts=EXPERTS, top_k=2, gemm=gemm, bias_update_rate=0.0)
    with torch.no_grad():  # x0 > 0: experts 0 and 1 (rank 0); x0 < 0: experts 3 and 2 (rank 1)
        moe.router.gate.weight.mul_(0.1)
        moe.router.gate.weight[0, 0] = 2.0
        moe.router.gate.weight[1, 0] = 1.0
        moe.router.gate.weight[3, 0] = -2.0
    return moe.to(dtype)


def check(dtype, gemm, mesh) -> dict[str, float]:
    rank = dist.get_rank()
    torch.manual_seed(1)
    x = torch.randn(2 * TOKENS, DIM, dtype=dtype)
    x[:TOKENS, 0] = x[:TOKENS, 0].abs() + 1.0  # rank 0's tokens: all to experts on rank 0
    g = torch.randn(2 * TOKENS, DIM, dtype=dtype)
    whole = layer(dtype, gemm)
    xa = x.clone().requires_grad_()
    (whole(xa) * g).sum().backward()
    split = layer(dtype, gemm)
    apply_expert_parallel(split, mesh)
    mine = slice(rank * TOKENS, (rank + 1) * TOKENS)
    xb = x[mine].clone().requires_grad_()
    out = split(xb)
    (out * g[mine]).sum().backward()
    diffs = {
        "output": (out - whole(x)[mine]).abs().max().item(),
        "input_grad": (xb.grad - xa.grad[mine]).abs().max().item(),
    }
    gate = split.router.gate.weight.grad.clone()
    dist.all_reduce(gate)  # each rank's share of the gate gradient comes from its own tokens
    diffs["gate_grad"] = (gate - whole.router.gate.weight.grad).abs().max().item()
    for name in ("w1", "w2", "w3"):
        local = getattr(split.experts, name).grad.to_local()
        ref = getattr(whole.experts, name).grad.chunk(2)[rank]
        diffs[f"{name}_grad"] = (local - ref).abs().max().item()
    diffs["rows_sent"] = split.rows_sent
    diffs["gate_grad_scale"] = whole.router.gate.weight.grad.abs().max().item()
    return diffs


def main() -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
    result = {
        "float64": check(torch.float64, "loop", mesh["ep"]),
        "float32": check(torch.float32, "grouped", mesh["ep"]),
    }
    with open(f"{sys.argv[1]}/rank{dist.get_rank()}.json", "w") as fh:
        json.dump(result, fh)
    dist.destroy_process_group()
    # Written and the group left. The interpreter's teardown would free the process groups
    # while gloo's threads may still hold them, which can abort the process ("terminate called
    # without an active exception", as framework/preflight/calibrate.py found): leave now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
