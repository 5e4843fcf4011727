"""torch's own transformer layers as one model family of the parallel core (framework/parallel/
model.py): `nn.MultiheadAttention`, `nn.TransformerEncoderLayer`, `nn.TransformerDecoderLayer`,
and the `nn.TransformerEncoder`, `nn.TransformerDecoder` and `nn.Transformer` built of them.

They declare no plan, but their structure is torch's, so it is known here: attention split by
whole heads (the `multihead_attention` style, framework/parallel/multihead.py), the feed-forward
`linear1` by columns and `linear2` by rows (one all-reduce after each), norms whole. The
encoder and decoder layers are the FSDP units and activation-checkpointing blocks. A model
made of them and plain modules (an embedding, an output layer) has the rest of its plan
inferred from its structure (framework/parallel/infer.py). There is no pipeline chain: a
decoder layer takes the encoder's output beside its own input, which a chain of stages does
not hand on, so pipeline parallel refuses these models as any model without layers in a chain.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from framework.errors import ConfigError
from framework.parallel.keys import matches
from framework.parallel.model import FamilyAdapter

LAYERS = (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)


class TorchLayersAdapter(FamilyAdapter):
    """The torch transformer layers a task holds (anywhere in it)."""

    name = "torch"
    standard_layers = True

    def claims(self, task: nn.Module) -> bool:
        return any(isinstance(m, (*LAYERS, nn.MultiheadAttention)) for m in task.modules())

    def tensor_plan(
        self, task: nn.Module, *, skip=(), sequence_parallel=False, loss_parallel=False, experts=()
    ) -> dict[str, Any]:
        plan: dict[str, str] = {}
        inside = tuple(f"{p}." for p in experts)
        for name, module in task.named_modules():
            if isinstance(module, nn.MultiheadAttention):
                plan[name] = "multihead_attention"
            elif isinstance(module, LAYERS):
                plan[f"{name}.linear1"] = "colwise"
                plan[f"{name}.linear2"] = "rowwise"
        plan = {
            k: v
            for k, v in plan.items()
            if not any(matches(p, k) for p in skip) and not f"{k}.".startswith(inside)
        }
        if plan and sequence_parallel:
            raise ConfigError(
                "strategy.sequence_parallel",
                True,
                f"{type(task).__name__} holds torch's transformer layers (nn.MultiheadAttention, "
                "nn.TransformerEncoderLayer, nn.TransformerDecoderLayer), whose plans have no "
                "sequence-parallel form",
                ["false"],
            )
        return plan

    def check_tensor(self, task: nn.Module, tp: int) -> None:
        """Heads, then feed-forward sizes, that split evenly over `tp` ranks."""
        modules = list(task.named_modules())
        for name, module in modules:
            if isinstance(module, nn.MultiheadAttention):
                _divides(name, module.num_heads, "attention heads", tp)
        for name, module in modules:
            if isinstance(module, LAYERS):
                _divides(name, module.linear1.out_features, "feed-forward units", tp)

    def blocks(self, task: nn.Module) -> list[nn.Module] | None:
        found = [m for m in task.modules() if isinstance(m, LAYERS)]
        return found or None


def _divides(name: str, size: int, what: str, tp: int) -> None:
    if size % tp:
        raise ConfigError(
            "strategy.tp",
            tp,
            f"torch's layer {name} has {size} {what}, which the tensor-parallel ranks split "
            "evenly, and they do not divide by it",
            [d for d in range(1, size + 1) if size % d == 0][:12],
        )


ADAPTER = TorchLayersAdapter()
