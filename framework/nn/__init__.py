"""Building blocks that carry their own tensor-parallel plans (Megatron-style sharding).

A model built from these blocks runs unchanged under `strategy=tensor`, `strategy=fsdp_tp` or any
`strategy.tp > 1`: the strategy asks every module with a `tp_plan()` method for its plan and
applies it on the tensor-parallel mesh (`framework.parallel.tensor.apply_tensor_parallel`). A module not
built from them can declare a plan the same way (a `tp_plan()` method), or the config can give
one (`strategy.tp_plan`).
"""

from framework.nn.blocks import (
    MLP,
    Attention,
    Embedding,
    LayerNorm,
    LMHead,
    SequenceSplit,
    TransformerBlock,
)
from framework.nn.functional import cross_entropy, full_tensor

__all__ = [
    "MLP",
    "Attention",
    "Embedding",
    "LMHead",
    "LayerNorm",
    "SequenceSplit",
    "TransformerBlock",
    "cross_entropy",
    "full_tensor",
]
