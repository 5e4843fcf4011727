"""Run by torch's launcher with 2 processes (tests/distributed/test_muon.py): Muon's
orthogonalisation of matrices that the ranks hold in parts, against the same matrices whole
in one process, in torch's bf16 Newton-Schulz. The parts: FSDP2's row shards (250 rows: 125
each; and 3 matrices of one shape, a last round of one), tensor parallel's column shards, and a
ZeRO-like flat partition of 3 matrices end to end, cut in the middle of the second. Every rank
builds the same whole matrices from one seed, so any difference is the exchange's: writes the
largest difference per case to OUT/rank<R>.json, and the number of Newton-Schulz iterations
each rank ran (each rank orthogonalises its own share of the matrices, whole)."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from framework.optim import muon
from framework.optim.muon import FlatLayout, FlatMatrix, Job, orthogonalize

WHOLE = muon.newton_schulz  # one process's orthogonalisation of a whole matrix

GROUP = {
    "ns_coefficients": (3.4445, -4.7750, 2.0315),
    "ns_steps": 5,
    "ns_eps": 1e-7,
    "ns_dtype": "bfloat16",
}


def whole(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def dtensor_case(mesh, shapes, placement) -> float:
    """Matrices sharded as `placement`: each rank's part of the result against its part of the
    result of the whole matrix."""
    fulls = [whole(*s, seed=i) for i, s in enumerate(shapes)]
    parts = [distribute_tensor(f, mesh, [placement]) for f in fulls]
    jobs = [Job(p, p, tuple(p.shape), GROUP) for p in parts]
    got = orthogonalize(jobs, {})
    worst = 0.0
    for full, part, result in zip(fulls, parts, got, strict=True):
        want = distribute_tensor(WHOLE(full, GROUP), mesh, [placement]).to_local()
        assert result.shape == part.to_local().shape
        worst = max(worst, (result - want).abs().max().item())
    return worst


def flat_case(group) -> float:
    """A flat buffer of three matrices end to end, each rank holding one half of it."""
    shapes = [(40, 24), (64, 48), (16, 32)]
    fulls = [whole(*s, seed=10 + i) for i, s in enumerate(shapes)]
    flat = torch.cat([f.reshape(-1) for f in fulls])
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    size = -(-flat.numel() // n)
    mine = torch.nn.functional.pad(flat, (0, size * n - flat.numel()))[
        rank * size : (rank + 1) * size
    ]
    matrices, starts = [], 0
    for s in shapes:
        numel = s[0] * s[1]
        ranges = []
        for r in range(n):
            first, last = max(starts, r * size), min(starts + numel, (r + 1) * size)
            ranges.append((first - starts, last - first) if last > first else (0, 0))
        offset = max(starts, rank * size) - rank * size if ranges[rank][1] else 0
        matrices.append(FlatMatrix(s, offset, ranges))
        starts += numel
    layout = FlatLayout(matrices, group)
    jobs = [
        Job(mine, mine.narrow(0, m.offset, m.ranges[rank][1]), m.shape, GROUP, m) for m in matrices
    ]
    got = orthogonalize(jobs, {id(mine): layout})
    worst = 0.0
    for full, m, result in zip(fulls, matrices, got, strict=True):
        start, count = m.ranges[rank]
        want = WHOLE(full, GROUP).reshape(-1)[start : start + count]
        assert result.numel() == count
        if count:  # a rank may hold none of a matrix
            worst = max(worst, (result - want).abs().max().item())
    return worst


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    runs = [0]

    def counted(matrix, group):
        runs[0] += 1
        return WHOLE(matrix, group)

    muon.newton_schulz = counted
    found = {
        "fsdp_rows": dtensor_case(mesh, [(250, 64), (64, 250)], Shard(0)),
        "fsdp_three_of_a_shape": dtensor_case(mesh, [(96, 64)] * 3, Shard(0)),
        "tp_columns": dtensor_case(mesh, [(64, 256), (256, 64)], Shard(1)),
    }
    found["zero_flat"] = flat_case(dist.group.WORLD)
    found["iterations"] = runs[0]
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump(found, fh)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
