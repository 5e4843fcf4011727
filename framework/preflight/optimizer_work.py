"""What a task's optimizer step costs `fw plan` beyond reading and writing its states: Muon's
Newton-Schulz matmuls and its exchange of whole matrices (framework/optim/muon.py).

The matmuls are counted on `fw check`'s simulated rank as its optimizer step runs them
(`matmul_counting`), by dtype, so they are the rank's own: all its hidden matrices where it
holds them whole (one process, ddp, pipeline stages), its round-robin share under sharded
layouts. `newton_schulz_flops` is the same count by formula, from torch's
`_zeropower_via_newtonschulz`. AdamW's step has no matmul: nothing is counted for it.

The exchange is computed from the optimizer's Muon groups (`exchange_bytes`), as
`framework.optim.muon.orthogonalize` groups the matrices, not taken from the simulated step:
the fake process group's CPU mesh re-shards by all-gathers where a GPU's all-to-all sends less.
DeepSpeed's ZeRO ranks are simulated as one whole replica: the strategy's `model_states` takes
their 1/N share of the Newton-Schulz and the exchange of their partition (`muon_bytes`).
"""

from __future__ import annotations

import math
from typing import Any


def newton_schulz_flops(rows: int, cols: int, steps: int = 5) -> int:
    """FLOPs of one Newton-Schulz orthogonalisation of a rows x cols matrix, as torch's
    `_zeropower_via_newtonschulz` runs it. The matrix is taken as X, m x n with m = min(rows,
    cols) <= n = max(rows, cols) (a tall one is transposed), and each of `steps` iterations is

        A = X @ X.T                      m x n by n x m:  2 m^2 n
        B = b A + c A @ A                m x m by m x m:  2 m^3   (addmm)
        X = a X + B @ X                  m x m by m x n:  2 m^2 n (addmm)

    so steps x (4 m^2 n + 2 m^3), a multiply-add counted as 2 FLOPs, as torch's FLOP counter
    counts mm and addmm (the scaled additions, the norm and the transposes are left out: a few
    elementwise passes over the matrix)."""
    m, n = min(rows, cols), max(rows, cols)
    return steps * (4 * m * m * n + 2 * m**3)


def matmul_counting():
    """A dispatch mode counting the FLOPs of the matmuls run under it, by the dtype they run in
    (`flops`: {"bf16": ..., "fp32": ...}) and how many (`calls`), with torch's formulas.
    Operations on DTensors are left to the local operations they run (the Newton-Schulz runs on
    whole local matrices)."""
    import torch
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import flop_registry

    names = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}

    class MatmulCounting(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.flops: dict[str, float] = {}
            self.calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            formula = flop_registry.get(func._overloadpacket)
            if formula is not None and not any(issubclass(t, DTensor) for t in types):
                dtype = names.get(getattr(out, "dtype", None), "fp32")
                self.flops[dtype] = self.flops.get(dtype, 0.0) + formula(
                    *args, **kwargs, out_val=out
                )
                self.calls += 1
            return out

    return MatmulCounting()


def muon_bytes(optimizer: Any) -> int:
    """Bytes of the matrices a Muon optimizer steps with Muon that this rank holds (its shards
    of them; 0 for any other optimizer): a ZeRO rank exchanges its partition of them
    (framework/strategies/deepspeed/memory.py)."""
    from framework.optim.muon import Muon, local

    if not isinstance(optimizer, Muon):
        return 0
    held = [local(p) for g in optimizer.param_groups if g.get("use_muon") for p in g["params"]]
    return sum(p.numel() * p.element_size() for p in held)


def exchange_bytes(optimizer: Any) -> float:
    """Bytes this rank sends in one step of a Muon optimizer's exchange (0 for any other):
    each hidden matrix sharded over a mesh (FSDP2, tensor parallel: a DTensor) is gathered
    whole on one rank and its result scattered back, in rounds of as many matrices of one
    shape as the mesh has ranks (muon.exchange_dtensors). In a round a rank sends its part of
    each of the N matrices to their owners, and its whole result back: twice its local part of
    the round's stack, N x its shard of one matrix (the (N-1)/N of a ring left out, as
    framework/preflight/traffic.py counts). A last round of fewer matrices sends the zeros that
    fill it too. A mesh dimension the matrix is replicated over sends nothing on it: counted as
    sharded, an upper bound (no built-in layout replicates a Muon matrix on its mesh)."""
    from framework.optim.muon import Muon, is_dtensor

    if not isinstance(optimizer, Muon):
        return 0.0
    buckets: dict[Any, list[Any]] = {}
    for group in optimizer.param_groups:
        if not group.get("use_muon"):
            continue
        for p in group["params"]:
            if is_dtensor(p) and any(placement.is_shard() for placement in p.placements):
                key = (id(p.device_mesh), tuple(p.placements), tuple(p.shape), p.dtype)
                buckets.setdefault(key, []).append(p)
    sent = 0.0
    for params in buckets.values():
        n = params[0].device_mesh.size()
        local = params[0].to_local()
        rounds = math.ceil(len(params) / n)
        sent += 2 * rounds * n * local.numel() * local.element_size()
    return sent
