"""A small decoder-only transformer over bytes (vocabulary of 256), built from `framework.nn`.

The blocks carry their tensor-parallel plans, so the same model runs under `strategy=tensor` or
`strategy=fsdp_tp` without changes here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from framework.nn import (
    Embedding,
    LayerNorm,
    LMHead,
    SequenceSplit,
    TransformerBlock,
    full_tensor,
)


class GPT(nn.Module):
    """Token + position embeddings, `n_layer` pre-norm blocks, a head tied to the embedding."""

    def __init__(
        self,
        vocab_size: int,
        block_size: int,
        n_layer: int,
        n_head: int,
        n_embd: int,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.block_size = block_size
        self.tok = Embedding(vocab_size, n_embd)
        self.pos = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.split = SequenceSplit()  # the residual stream is split over positions from here (sp)
        self.blocks = nn.ModuleList(
            TransformerBlock(n_embd, n_head, dropout) for _ in range(n_layer)
        )
        self.ln_f = LayerNorm(n_embd)
        self.head = LMHead(n_embd, vocab_size)
        self.head.weight = self.tok.weight
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):  # the two residual projections of every block
                nn.init.normal_(p, std=0.02 / (2 * n_layer) ** 0.5)

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        positions = self.split.positions(t, idx.device)  # this rank's chunks under cp
        return self.split(self.drop(self.tok(idx) + self.pos(positions)))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln_f(x))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.logits(x)

    def pipeline_layers(self) -> list:
        """The chain pipeline parallelism cuts into stages: embeddings, each block, norm + head."""
        return [
            (("tok", "pos", "drop", "split"), self.embed),
            *(((f"blocks.{i}",), block) for i, block in enumerate(self.blocks)),
            (("ln_f", "head"), self.logits),
        ]

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        length: int,
        temperature: float = 0.8,
        top_k: int = 50,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        for _ in range(length):
            context = idx[:, -self.block_size :]
            last = context.shape[1] - 1
            logits = full_tensor(self(self.split.pad(context)))[:, last, :]
            logits = logits / max(temperature, 1e-5)
            if top_k:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
            idx = torch.cat([idx, nxt], dim=1)
        return idx
