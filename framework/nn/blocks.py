"""Transformer blocks whose plans shard them Megatron-style over the tensor-parallel ranks.

Attention: the fused query/key/value projection is split by columns (each rank gets whole heads:
its output features are ordered head by head, q, k and v of one head side by side), the output
projection by rows; the MLP: the first linear by columns, the second by rows. A block
therefore needs one all-reduce after attention and one after the MLP in forward, and the same two
in backward (for the input gradients of the column-split linears). The token embedding and the
LM head are split over the vocabulary; position embeddings and norms stay whole on every rank.

With sequence parallelism (`strategy.sequence_parallel=true`) the residual stream between the
blocks is split over the sequence instead of replicated: norms (and dropout) run on this rank's
positions only, each all-reduce becomes a reduce-scatter (after the row-split linear) plus an
all-gather (before the next column-split one): the same bytes, less activation memory.
`SequenceSplit` marks where the residual stream enters that region; the LM head gathers it.

Under context parallel (`strategy.cp > 1`) each rank holds chunks of every sequence:
`parallelize` gives `Attention` and `SequenceSplit` a `context` plan (framework/parallel/context/__init__.py),
by which attention reaches the other ranks' keys and values and the position ids follow the
split.

Each `tp_plan(sequence_parallel)` returns {submodule name: style name (or a torch ParallelStyle)},
relative to the block itself; the styles are described in `framework.parallel.tensor.style`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    """Causal multi-head self-attention; heads are split over the tensor-parallel ranks, the
    sequence over the context-parallel ones."""

    context = None  # a framework.parallel.context.ContextPlan under context parallel

    def __init__(self, n_embd: int, n_head: int, dropout: float = 0.0, bias: bool = True) -> None:
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_head={n_head} must divide n_embd={n_embd}")
        self.n_head = n_head
        self.head_dim = n_embd // n_head
        # output features ordered (head, q/k/v, head_dim): a split by columns keeps heads whole
        self.qkv = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: all of them on one process, this rank's share under tensor parallelism
        qkv = self.qkv(x).view(b, t, -1, 3, self.head_dim)
        q, k, v = (z.transpose(1, 2) for z in qkv.unbind(dim=3))
        if self.context is not None and self.context.active:
            y = self.context.attention(q, k, v, causal=True)
        else:
            p = self.dropout if self.training else 0.0
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))

    def tp_plan(self, sequence_parallel: bool = False) -> dict:
        if sequence_parallel:
            return {"": "gather_sequence", "qkv": "colwise", "proj": "rowwise_scatter_sequence"}
        return {"qkv": "colwise", "proj": "rowwise"}


class MLP(nn.Module):
    """Linear -> GELU -> linear (-> dropout); the hidden layer is split over the ranks."""

    def __init__(self, n_embd: int, hidden: int, dropout: float = 0.0, bias: bool = True) -> None:
        super().__init__()
        self.fc = nn.Linear(n_embd, hidden, bias=bias)
        self.proj = nn.Linear(hidden, n_embd, bias=bias)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))

    def tp_plan(self, sequence_parallel: bool = False) -> dict:
        if sequence_parallel:
            return {"": "gather_sequence", "fc": "colwise", "proj": "rowwise_scatter_sequence"}
        return {"fc": "colwise", "proj": "rowwise"}


class LayerNorm(nn.LayerNorm):
    """LayerNorm; whole on every tensor-parallel rank, run on this rank's positions under
    sequence parallelism."""

    def tp_plan(self, sequence_parallel: bool = False) -> dict:
        return {"": "sequence"} if sequence_parallel else {}


class SequenceSplit(nn.Identity):
    """Where the residual stream enters the sequence-parallel region (identity otherwise).

    Under sequence parallelism every sequence must split evenly over the ranks: `multiple` is
    then the tensor-parallel degree, and `pad` right-pads token ids to a multiple of it (for
    generation, whose context grows one token at a time; causal attention keeps the padding out
    of the real positions).
    """

    multiple = 1
    context = None  # a framework.parallel.context.ContextPlan under context parallel

    def positions(self, length: int, device) -> torch.Tensor:
        """Position ids of the `length` positions this rank holds (its chunks under context
        parallel)."""
        if self.context is not None and self.context.active:
            return self.context.positions(length, device)
        return torch.arange(length, device=device)

    def tp_plan(self, sequence_parallel: bool = False) -> dict:
        return {"": "split_sequence"} if sequence_parallel else {}

    def pad(self, idx: torch.Tensor) -> torch.Tensor:
        extra = (-idx.shape[1]) % self.multiple
        return F.pad(idx, (0, extra)) if extra else idx


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(
        self, n_embd: int, n_head: int, dropout: float = 0.0, mlp_ratio: int = 4, bias: bool = True
    ) -> None:
        super().__init__()
        self.ln1 = LayerNorm(n_embd)
        self.attn = Attention(n_embd, n_head, dropout, bias)
        self.ln2 = LayerNorm(n_embd)
        self.mlp = MLP(n_embd, mlp_ratio * n_embd, dropout, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Embedding(nn.Embedding):
    """Token embedding split over the vocabulary (rows); the output is summed over the ranks."""

    def tp_plan(self, sequence_parallel: bool = False) -> dict:
        return {"": "rowwise_embedding"}


class LMHead(nn.Linear):
    """Output projection to the vocabulary, split over it (columns); logits gathered for the loss.

    Its weight may be tied to an `Embedding`'s: both are split over the vocabulary the same way,
    and the tie is kept after sharding.
    """

    def __init__(self, n_embd: int, vocab_size: int) -> None:
        super().__init__(n_embd, vocab_size, bias=False)

    def tp_plan(self, sequence_parallel: bool = False, loss_parallel: bool = False) -> dict:
        """Logits gathered, or (loss_parallel) left split over the vocabulary as a DTensor for
        a cross-entropy computed without gathering them (torch's `loss_parallel`)."""
        name = "colwise_sharded_logits" if loss_parallel else "colwise_gather"
        return {"": f"{name}_from_sequence" if sequence_parallel else name}
