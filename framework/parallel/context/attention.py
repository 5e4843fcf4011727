"""Context-parallel attention: the collectives and the attention of one rank's zigzag chunks
over the whole sequence (framework/parallel/context/__init__.py holds the plan, the batch split and the checks).

The sequence of `length` positions is cut into `2 x cp` equal chunks; rank r keeps chunks r and
2cp-1-r (`zigzag_index`), which `block_parts` relies on: a K/V block from an earlier rank is seen
by every local query through its head chunk only, one from a later rank by the local tail chunk
only. The collectives are autograd Functions on torch.distributed's plain ones (all_gather,
reduce_scatter, all_to_all, batched isend/irecv), so they run on gloo as on NCCL. Each block's
attention is one call of the device's fused kernel (framework/parallel/context/kernels.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from framework.parallel.context import kernels


def zigzag_index(length: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """Positions (of `length`) that rank `rank` of `cp` keeps: chunks rank and 2cp-1-rank."""
    if length % (2 * cp):
        raise ValueError(
            f"a sequence of {length} positions does not split into 2 x cp = {2 * cp} equal chunks"
        )
    n = length // (2 * cp)
    head = torch.arange(rank * n, (rank + 1) * n, device=device)
    tail = torch.arange((2 * cp - 1 - rank) * n, (2 * cp - rank) * n, device=device)
    return torch.cat([head, tail])


def zigzag_order(length: int, cp: int, device=None) -> torch.Tensor:
    """The positions of the sequence as the group's chunks lie end to end, rank after rank."""
    return torch.cat([zigzag_index(length, cp, r, device) for r in range(cp)])


# ---- the collectives, differentiable


class _AllGather(torch.autograd.Function):
    """(cp, *x.shape): every rank's x; backward: the gradients of my x summed over the ranks."""

    @staticmethod
    def forward(ctx, x, group, size):
        ctx.group = group
        out = x.new_empty((size * x.shape[0], *x.shape[1:]))
        dist.all_gather_single(out, x.contiguous(), group=group)
        return out.view(size, *x.shape)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter(grad, ctx.group), None, None


class _AllToAll(torch.autograd.Function):
    """x[c] goes to rank c, out[c] comes from rank c; its own inverse (backward)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_to_all(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_to_all(grad, ctx.group), None


def all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def exchange(x: torch.Tensor, group, to: int, source: int) -> torch.Tensor:
    """x sent to rank `to` of `group`, the tensor rank `source` sends returned. The send and
    the receive are issued as one batch: NCCL runs a send only once the peer's matching receive
    is posted, so two ranks that each first send to the other (cp=2: `to` is `source`) would
    both wait behind their own receive for any block above NCCL's buffers (gloo buffers sends,
    so only NCCL hangs)."""
    x = x.contiguous()
    out = torch.empty_like(x)
    ops = [
        dist.P2POp(dist.isend, x, group=group, group_peer=to),
        dist.P2POp(dist.irecv, out, group=group, group_peer=source),
    ]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return out


# ---- attention


def merge(out, lse, out2, lse2) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial attentions over disjoint key blocks as one (online softmax)."""
    total = torch.logaddexp(lse, lse2)
    a, b = torch.exp(lse - total).unsqueeze(-1), torch.exp(lse2 - total).unsqueeze(-1)
    return out * a + out2 * b, total


def block_parts(step: int, source: int, rank: int, half: int, causal: bool):
    """Which local query rows and which of a block's key columns attend to each other (slices),
    and whether with a causal mask: the whole diagonal block causally (its two chunks in order),
    under the zigzag split an earlier rank's head chunk by every row, a later rank's whole block
    by the tail rows; without a mask, everything."""
    every = slice(None)
    if step == 0:
        return every, every, causal
    if not causal:
        return every, every, False
    if source < rank:
        return every, slice(0, half), False
    return slice(half, None), every, False


class _SplitAttention(torch.autograd.Function):
    """Attention of the local queries over every rank's K/V blocks, one fused-kernel call per
    block (framework/parallel/context/kernels.py) merged by log-sum-exp; backward per block with
    the merged output and log-sum-exp. `ring`: blocks passed rank to rank (forward and again in
    backward, with their gradients travelling along and returned to their owner); `allgather`:
    all blocks gathered at once (kept for backward), their gradients reduce-scattered. K/V keep
    their own head count (grouped-query attention) on the way; a kernel that needs them repeated
    repeats them per block."""

    @staticmethod
    def forward(ctx, q, k, v, causal, mode, group, size, rank, kernel):
        half = q.shape[2] // 2
        kv = torch.stack([k, v])
        every = _AllGather.apply(kv, group, size) if mode == "allgather" else None
        out, lse = None, None
        for step in range(size):
            source = (rank - step) % size
            if every is not None:
                kv = every[source]
            elif step:
                kv = exchange(kv, group, (rank + 1) % size, (rank - 1) % size)
            rows, cols, masked = block_parts(step, source, rank, half, causal)
            o, m = kernels.block(
                q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols], masked, kernel
            )
            m = m.to(torch.promote_types(m.dtype, torch.float32))
            if out is None:
                out, lse = o.to(m.dtype), m
            else:
                out[:, :, rows], lse[:, :, rows] = merge(out[:, :, rows], lse[:, :, rows], o, m)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, *([every] if every is not None else []))
        ctx.args = causal, mode, group, size, rank, kernel
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, *kept = ctx.saved_tensors
        causal, mode, group, size, rank, kernel = ctx.args
        half = q.shape[2] // 2
        acc = lse.dtype  # gradients summed over blocks in fp32 (fp64 for fp64 inputs)
        dq = torch.zeros_like(q, dtype=acc)
        kv = torch.stack([k, v])
        dkv = torch.zeros_like(kv, dtype=acc)
        every = kept[0] if kept else None
        devery = torch.zeros_like(every, dtype=acc) if every is not None else None
        for step in range(size):
            source = (rank - step) % size
            if every is not None:
                kv, dkv = every[source], devery[source]
            elif step:  # the block and the gradients its earlier holders gave it
                both = exchange(
                    torch.cat([kv.to(acc), dkv]), group, (rank + 1) % size, (rank - 1) % size
                )
                kv, dkv = both[:2].to(q.dtype), both[2:]
            rows, cols, masked = block_parts(step, source, rank, half, causal)
            grads = kernels.block_backward(
                dout[:, :, rows],
                q[:, :, rows],
                kv[0][:, :, cols],
                kv[1][:, :, cols],
                out[:, :, rows],
                lse[:, :, rows],
                masked,
                kernel,
            )
            dq[:, :, rows] += grads[0]
            dkv[0][:, :, cols] += grads[1]
            dkv[1][:, :, cols] += grads[2]
        if every is not None:
            dkv = reduce_scatter(devery, group)
        elif size > 1:  # the last block's gradients, complete, back to their owner
            dkv = exchange(dkv, group, (rank + 1) % size, (rank - 1) % size)
        dtype = q.dtype
        grads = dq.to(dtype), dkv[0].to(dtype), dkv[1].to(dtype)
        return (*grads, None, None, None, None, None, None)


def reduce_scatter(x: torch.Tensor, group) -> torch.Tensor:
    """x (cp, ...) summed over the ranks, this rank's row."""
    out = x.new_empty(x.shape[1:])
    dist.reduce_scatter_single(out, x.reshape(-1, *x.shape[2:]).contiguous(), group=group)
    return out


def split_attention(q, k, v, causal, mode, group, size, rank, kernel=None) -> torch.Tensor:
    """Ring or allgather attention of this rank's queries (batch, heads, local positions,
    head_dim) over the group's K/V (which may have fewer heads: grouped-query attention), on
    the device's kernel (kernels.kernel_for) unless `kernel` names one."""
    if k.shape[1] != v.shape[1] or q.shape[1] % k.shape[1]:
        raise ValueError(
            f"{q.shape[1]} query heads cannot share {k.shape[1]} key and {v.shape[1]} value heads"
        )
    kernel = kernel or kernels.kernel_for(q)
    return _SplitAttention.apply(q, k, v, causal, mode, group, size, rank, kernel)


def ulysses_attention(q, k, v, causal, group, size) -> torch.Tensor:
    b, h, s, d = q.shape
    if h % size:
        raise ValueError(f"ulysses needs heads ({h}) divisible by cp={size}")
    length = s * size
    order = zigzag_order(length, size, q.device)
    natural = torch.argsort(order)  # gathered (zigzag) order -> sequence order

    def to_heads(x):  # (b, h, s, d) local positions -> (b, h/cp, length, d) in sequence order
        x = x.reshape(b, size, h // size, s, d).transpose(0, 1)
        x = _AllToAll.apply(x, group)  # [c]: rank c's positions of my heads
        x = x.permute(1, 2, 0, 3, 4).reshape(b, h // size, length, d)
        return x.index_select(2, natural)

    y = F.scaled_dot_product_attention(to_heads(q), to_heads(k), to_heads(v), is_causal=causal)
    y = y.index_select(2, order).reshape(b, h // size, size, s, d).permute(2, 0, 1, 3, 4)
    y = _AllToAll.apply(y, group)  # [c]: my positions of rank c's heads
    return y.transpose(0, 1).reshape(b, h, s, d)
