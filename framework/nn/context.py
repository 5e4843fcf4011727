"""Context parallel: each sequence split over the `cp` ranks, attention computed across them.

The ranks of a context-parallel group read the same batch. Each keeps two of the sequence's
`2 x cp` equal chunks, chunk `r` and chunk `2cp-1-r` ("zigzag"): under a causal mask early
positions attend to few keys and late ones to many, so a head chunk paired with a tail chunk
gives every rank the same attention work. Inputs, targets and position ids follow the same split
(`split_batch`, `ContextPlan.positions`); everything but attention is per position and runs on
the local chunks unchanged. Attention needs the keys and values of the whole sequence, by one of
three modes:

- `allgather`: K/V all-gathered once per layer; simplest, holds the whole sequence's K/V;
- `ring`: K/V blocks passed around the group (cp-1 sends), each block's partial attention merged
  by its log-sum-exp (online softmax); with the zigzag split a block from an earlier rank is seen
  by all local queries through its head chunk only, one from a later rank by the local tail
  chunk only, so no step but the first needs a mask;
- `ulysses`: an all-to-all turns the sequence split into a head split (heads / cp per rank, the
  whole sequence), attention runs as on one process, and a second all-to-all turns it back.

The collectives are autograd Functions on torch.distributed's plain ones (all_gather,
reduce_scatter, all_to_all, isend/irecv), so they run on gloo as on NCCL. `parallelize` gives
every module with a `context` attribute (framework.nn.Attention, SequenceSplit) one shared
`ContextPlan`; the strategy turns it on for the training and validation steps (`running`), so
the same model run outside them (sampling at the end of training) attends as on one process.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from framework.errors import ConfigError

MODES = ("ring", "allgather", "ulysses")


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


@dataclass
class ContextPlan:
    """How this rank's attention reaches the rest of its sequence (one object per model)."""

    mode: str
    group: Any  # the cp ranks' process group
    size: int
    rank: int
    active: bool = False  # on during the strategy's steps only (see `running`)

    def positions(self, local_length: int, device) -> torch.Tensor:
        """Position ids of this rank's tokens."""
        return zigzag_index(local_length * self.size, self.size, self.rank, device)

    def split(self, batch: Any) -> Any:
        """This rank's chunks of every tensor of `batch` with 2 or more dimensions (dim 1 is the
        sequence); other values as they are."""
        if torch.is_tensor(batch):
            if batch.dim() < 2:
                return batch
            index = zigzag_index(batch.shape[1], self.size, self.rank, batch.device)
            return batch.index_select(1, index)
        if isinstance(batch, (list, tuple)):
            return type(batch)(self.split(b) for b in batch)
        if isinstance(batch, dict):
            return {k: self.split(v) for k, v in batch.items()}
        return batch

    def attention(self, q, k, v, causal: bool = True) -> torch.Tensor:
        """Attention of the local queries (batch, heads, local positions, head_dim) over the
        whole sequence's keys and values."""
        if self.mode == "ulysses":
            return ulysses_attention(q, k, v, causal, self.group, self.size)
        return split_attention(q, k, v, causal, self.mode, self.group, self.size, self.rank)


@contextlib.contextmanager
def running(plan: ContextPlan | None):
    """The plan in force for the block's span (nothing to do without one)."""
    if plan is None:
        yield
        return
    before, plan.active = plan.active, True
    try:
        yield
    finally:
        plan.active = before


def apply_context_parallel(model: nn.Module, group, mode: str) -> ContextPlan:
    """Give every module of `model` with a `context` attribute one plan over `group`."""
    plan = ContextPlan(mode, group, dist.get_world_size(group), dist.get_rank(group))
    for module in model.modules():
        if hasattr(module, "context"):
            module.context = plan
    return plan


def plan_of(model: nn.Module) -> ContextPlan | None:
    for module in model.modules():
        if getattr(module, "context", None) is not None:
            return module.context
    return None


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


class _RingPass(torch.autograd.Function):
    """x sent to the next rank of the group, the previous rank's returned; backward the other way."""

    @staticmethod
    def forward(ctx, x, group, size, rank):
        ctx.args = group, size, rank
        return exchange(x, group, (rank + 1) % size, (rank - 1) % size)

    @staticmethod
    def backward(ctx, grad):
        group, size, rank = ctx.args
        return exchange(grad, group, (rank - 1) % size, (rank + 1) % size), None, None, None


def exchange(x: torch.Tensor, group, to: int, source: int) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    works = [
        dist.isend(x, group=group, group_dst=to),
        dist.irecv(out, group=group, group_src=source),
    ]
    for work in works:
        work.wait()
    return out


# ---- attention


def flash(q, k, v, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, log-sum-exp of the scores (batch, heads, positions)) of one block, by
    torch's fused CPU kernel: no score matrix is kept."""
    q, k, v = (t.contiguous() for t in (q, k, v))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
    return out, lse  # lse in fp32 (fp64 for fp64 inputs)


def flash_backward(dout, q, k, v, out, lse, causal: bool):
    """(dq, dk, dv) of one block, given the output and log-sum-exp of the whole attention (the
    softmax's normalisation over every block)."""
    args = [t.contiguous() for t in (dout, q, k, v, out)]
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        *args, lse.contiguous(), 0.0, causal
    )


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
    block merged by log-sum-exp; backward per block with the merged output and log-sum-exp.
    `ring`: blocks passed rank to rank (forward and again in backward, with their gradients
    travelling along and returned to their owner); `allgather`: all blocks gathered at once
    (kept for backward), their gradients reduce-scattered."""

    @staticmethod
    def forward(ctx, q, k, v, causal, mode, group, size, rank):
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
            o, m = flash(q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols], masked)
            if out is None:
                out, lse = o.to(m.dtype), m
            else:
                out[:, :, rows], lse[:, :, rows] = merge(out[:, :, rows], lse[:, :, rows], o, m)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, *([every] if every is not None else []))
        ctx.args = causal, mode, group, size, rank
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, *kept = ctx.saved_tensors
        causal, mode, group, size, rank = ctx.args
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
            grads = flash_backward(
                dout[:, :, rows],
                q[:, :, rows],
                kv[0][:, :, cols],
                kv[1][:, :, cols],
                out[:, :, rows],
                lse[:, :, rows],
                masked,
            )
            dq[:, :, rows] += grads[0]
            dkv[0][:, :, cols] += grads[1]
            dkv[1][:, :, cols] += grads[2]
        if every is not None:
            dkv = reduce_scatter(devery, group)
        elif size > 1:  # the last block's gradients, complete, back to their owner
            dkv = exchange(dkv, group, (rank + 1) % size, (rank - 1) % size)
        dtype = q.dtype
        return dq.to(dtype), dkv[0].to(dtype), dkv[1].to(dtype), None, None, None, None, None


def reduce_scatter(x: torch.Tensor, group) -> torch.Tensor:
    """x (cp, ...) summed over the ranks, this rank's row."""
    out = x.new_empty(x.shape[1:])
    dist.reduce_scatter_single(out, x.reshape(-1, *x.shape[2:]).contiguous(), group=group)
    return out


def split_attention(q, k, v, causal, mode, group, size, rank) -> torch.Tensor:
    if q.device.type != "cpu":  # the fused kernel used here is the CPU one
        return split_attention_math(q, k, v, causal, mode, group, size, rank)
    return _SplitAttention.apply(q, k, v, causal, mode, group, size, rank)


def split_attention_math(q, k, v, causal, mode, group, size, rank) -> torch.Tensor:
    """The same blocks and merge in differentiable torch ops (score matrices kept for backward:
    more memory), for devices without the CPU kernel."""
    half = q.shape[2] // 2
    kv = torch.stack([k, v])
    every = _AllGather.apply(kv, group, size) if mode == "allgather" else None
    out, lse = None, None
    for step in range(size):
        source = (rank - step) % size
        if every is not None:
            kv = every[source]
        elif step:
            kv = _RingPass.apply(kv, group, size, rank)
        rows, cols, masked = block_parts(step, source, rank, half, causal)
        o, m = math_block(q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols], masked)
        if out is None:
            out, lse = o, m
        elif rows.start is None:
            out, lse = merge(out, lse, o, m)
        else:
            o, m = merge(out[:, :, rows], lse[:, :, rows], o, m)
            out = torch.cat([out[:, :, :half], o], dim=2)
            lse = torch.cat([lse[:, :, :half], m], dim=2)
    return out.to(q.dtype)


def math_block(q, k, v, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    if causal:
        n = scores.shape[-1]
        keep = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(scores.to(torch.promote_types(scores.dtype, torch.float32)), dim=-1)
    return torch.exp(scores - lse.unsqueeze(-1).to(scores.dtype)) @ v, lse


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


# ---- checks before launch (in the fw process)


def check_lengths(task_class: type, model_args: dict, cp: int) -> None:
    """The sequence lengths the task names (its `context_parallel_dims`) split into 2 x cp
    chunks."""
    lengths = getattr(task_class, "context_parallel_dims", None)
    if lengths is None:
        return
    for key, value in lengths(model_args).items():
        if value % (2 * cp):
            raise ConfigError(
                f"task.model.{key}",
                value,
                f"context parallel splits each sequence into 2 x cp = {2 * cp} equal chunks "
                f"(strategy.cp={cp}), which must divide it",
                hint=f"Choose a multiple of {2 * cp}, or another strategy.cp.",
            )


def check_model(model: nn.Module, cp: int, mode: str, tp: int = 1) -> None:
    """The model's attention can be split over the sequence: framework.nn attention (a module
    with a `context` attribute) and no other attention; heads that split for ulysses."""
    name = type(model).__name__
    splittable = [(n, m) for n, m in model.named_modules() if hasattr(m, "context")]
    other = [
        (n, m)
        for n, m in model.named_modules()
        if "attention" in type(m).__name__.lower() and not hasattr(m, "context")
    ]
    if other:
        where, module = other[0]
        raise ConfigError(
            "strategy.cp",
            cp,
            f"{where} ({type(module).__name__}) of {name} is an attention context parallel "
            "cannot split over the sequence",
            [1],
            hint="Build attention from framework.nn.Attention, or use strategy.cp=1.",
        )
    attention = [(n, m) for n, m in splittable if hasattr(m, "n_head")]
    if not attention:
        raise ConfigError(
            "strategy.cp",
            cp,
            f"{name} has no attention context parallel can split (framework.nn.Attention): "
            "its sequences would be cut with nothing to join them",
            [1],
        )
    for where, module in attention:
        if module.dropout:
            raise ConfigError(
                "strategy.cp",
                cp,
                f"{where} drops attention weights (dropout={module.dropout}), which context "
                "parallel does not apply",
                [1],
                hint="Set the model's dropout to 0, or use strategy.cp=1.",
            )
        heads = module.n_head // tp
        if mode == "ulysses" and heads % cp:
            raise ConfigError(
                "strategy.cp",
                cp,
                f"cp_mode=ulysses splits the heads over the cp ranks: {where} has {heads} heads "
                f"per tensor-parallel rank, which cp does not divide",
                [d for d in range(1, heads + 1) if heads % d == 0],
                hint="Use cp_mode=ring or allgather, or a cp that divides the heads.",
            )
