"""Where each Muon matrix lies in DeepSpeed's ZeRO partitions (imports DeepSpeed's optimizer
objects only as given: workers only).

ZeRO hands the wrapped torch optimizer flat fp32 partitions in place of a group's parameters:
stages 1-2 one per parameter group (the group's parameters end to end, with DeepSpeed's
alignment padding, cut into one equal stretch per rank), stage 3 one per sub-group (each
parameter cut into one equal stretch per rank, this rank's stretches end to end). `bind`
describes, for each partition of a Muon group, which stretch of which matrix every rank holds
and where this rank's lies in its partition (framework.optim.muon.FlatLayout), so that the
Muon optimizer can gather each matrix whole on one rank for its Newton-Schulz step.
"""

from __future__ import annotations

from framework.optim.muon import FlatLayout, FlatMatrix, Muon


def bind(ds_optimizer) -> int:
    """Describe the Muon groups' partitions to the Muon optimizer DeepSpeed wraps (nothing for
    any other optimizer); returns the matrices described."""
    base = getattr(ds_optimizer, "optimizer", None)
    if not isinstance(base, Muon):
        return 0
    if hasattr(ds_optimizer, "fp32_partitioned_groups_flat"):
        layouts = stage3_layouts(ds_optimizer, base)
    else:
        layouts = stage12_layouts(ds_optimizer, base)
    for flat, layout in layouts:
        base.bind_flat(flat, layout)
    return sum(len(layout.matrices) for _, layout in layouts)


def stage12_layouts(ds_opt, base) -> list:
    """ZeRO-1/2: partition i of `partition_size[i]` elements is rank i's stretch of the
    group's flat buffer, where parameter j starts at `round_robin_bit16_offsets[i][j]`."""
    import torch.distributed as dist

    out = []
    for i, params in enumerate(ds_opt.round_robin_bit16_groups):
        if not base.param_groups[i].get("use_muon"):
            continue
        group = ds_opt.real_dp_process_group[i]
        n, me, size = (
            dist.get_world_size(group),
            dist.get_rank(group),
            int(ds_opt.partition_size[i]),
        )
        matrices = []
        for p, start in zip(params, ds_opt.round_robin_bit16_offsets[i], strict=True):
            ranges = [overlap(start, p.numel(), r * size, size) for r in range(n)]
            offset = max(start, me * size) - me * size if ranges[me][1] else 0
            matrices.append(FlatMatrix(tuple(p.shape), offset, ranges))
            check_fragment(p, ranges[me], offset)
        out.append((ds_opt.single_partition_of_fp32_groups[i], FlatLayout(matrices, group)))
    return out


def overlap(start: int, numel: int, lo: int, size: int) -> tuple[int, int]:
    """The stretch (start within the matrix, count) of a matrix at [start, start + numel) of a
    flat buffer that the partition [lo, lo + size) holds."""
    first, last = max(start, lo), min(start + numel, lo + size)
    return (first - start, last - first) if last > first else (0, 0)


def check_fragment(p, stretch: tuple[int, int], offset: int) -> None:
    """The stretch computed here is the one DeepSpeed mapped (its `_hp_mapping`), so that a
    change of its layout fails loudly instead of orthogonalising the wrong elements."""
    hp = getattr(p, "_hp_mapping", None)
    if hp is None:
        if stretch[1]:
            raise RuntimeError("DeepSpeed holds no fragment where Muon expects one")
        return
    lp = hp.lp_fragment_address
    if (lp.start, lp.numel) != stretch or hp.hp_fragment_address.start != offset:
        raise RuntimeError(
            f"DeepSpeed's partition layout changed: fragment {(lp.start, lp.numel)} at "
            f"{hp.hp_fragment_address.start}, expected {stretch} at {offset}"
        )


def stage3_layouts(ds_opt, base) -> list:
    """ZeRO-3: each parameter cut into stretches of `ds_tensor.numel()` elements, rank r's
    from r times that; this rank's lies at `grad_position`'s offset in its sub-group's flat."""
    import torch.distributed as dist

    out = []
    group = ds_opt.dp_process_group
    n = dist.get_world_size(group)
    for sub, params in enumerate(ds_opt.fp16_groups):
        if not base.param_groups[ds_opt.sub_group_to_group_id[sub]].get("use_muon"):
            continue
        matrices = []
        for p in params:
            part, numel = p.ds_tensor.numel(), p.ds_numel
            ranges = [(r * part, max(0, min(part, numel - r * part))) for r in range(n)]
            _, offset, _count = ds_opt.grad_position[ds_opt.get_param_id(p)]
            matrices.append(FlatMatrix(tuple(p.ds_shape), int(offset), ranges))
        out.append((ds_opt.fp32_partitioned_groups_flat[sub], FlatLayout(matrices, group)))
    return out
