"""The gpt recipe's model with a mixture of experts in every block (framework.nn MoE blocks).

Embeddings, attention, norms and the tied head are the gpt recipe's; each block's MLP is a
`framework.nn.MoE`: a top-k router over `num_experts` SwiGLU experts. The same model runs under
any expert-parallel degree (`strategy=expert`, `strategy.ep=N`) with no change here.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from framework.nn.moe import MoE, MoETransformerBlock
from recipes.gpt.model import GPT


class MoEGPT(GPT):
    """GPT with `MoETransformerBlock`s; `moe` holds the MoE layers' arguments."""

    def __init__(
        self,
        vocab_size: int,
        block_size: int,
        n_layer: int,
        n_head: int,
        n_embd: int,
        moe: dict[str, Any],
        dropout: float = 0.0,
    ) -> None:
        super().__init__(vocab_size, block_size, n_layer, n_head, n_embd, dropout)
        self.blocks = nn.ModuleList(
            MoETransformerBlock(n_embd, n_head, moe, dropout) for _ in range(n_layer)
        )
        self.blocks.apply(self._init)
        for name, p in self.blocks.named_parameters():
            if name.endswith("proj.weight") or name.endswith("w2"):  # residual projections
                nn.init.normal_(p, std=0.02 / (2 * n_layer) ** 0.5)

    def moe_layers(self) -> list[MoE]:
        return [block.moe for block in self.blocks if block is not None]

    def aux_loss(self) -> torch.Tensor:
        """The routers' load-balancing and z-losses of the last forward (0 when off)."""
        losses = [m.router.aux_loss for m in self.moe_layers()]
        return torch.stack(losses).sum() if losses else torch.zeros(())
