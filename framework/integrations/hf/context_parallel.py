"""Context parallel for transformers models (>= 5): their attention, positions and labels.

transformers routes every attention call of a model through a registry of attention functions
(`AttentionInterface`), chosen by the config's `_attn_implementation`. Under `strategy.cp > 1`
the models in a task are switched to one registered here (`fw_context`), which hands the local
queries and the local keys and values (this rank's zigzag chunks) to the model's context plan
(framework/parallel/context/__init__.py: ring, allgather or ulysses) while the plan is on, and to transformers'
own SDPA attention and masks otherwise (sampling after training attends as on one process).

Before each forward of the model, while the plan is on (under a pipeline, where the model's
forward is not called, its decoder layers take the plan's positions and its loss the shifted
labels and count the same way: framework/integrations/hf/pipelining.py):
- `position_ids` are this rank's positions (rotary or learned position embeddings follow the
  zigzag split);
- `labels` (a causal LM's, shifted inside transformers) become `shift_labels`: the next token
  of each local position, the chunk boundaries' ones fetched from the neighbouring chunks'
  owners (one small all-gather); `num_items_in_batch` is the group's count of counted labels
  over cp, so the cp ranks' averaged gradients are those of the mean over all the group's
  tokens, not a mean of per-chunk means;
- an `attention_mask` must keep every position: padding cannot be split. It is replaced by an
  empty 4-D mask, which transformers passes on as a prepared mask: it builds none (the split
  attention is causal by construction; a mask of the local chunks would be wrong, as their
  positions jump, and at long sequences large).

Refused before launch (`check`): a model whose attention does not go through the registry, a
sliding window, soft-capped logits, attention dropout, a head other than a causal LM's, a
forward without `position_ids`, and ulysses with heads per tensor-parallel rank that cp does
not divide.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from framework.errors import ConfigError
from framework.integrations.hf import plans

NAME = "fw_context"  # the attention implementation registered with transformers
IGNORE = -100  # transformers' ignore index for labels


def attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's self-attention modules (those it hands to the attention function)."""
    return [
        (n, m)
        for n, m in model.named_modules()
        if "attention" in type(m).__name__.lower() and hasattr(m, "layer_idx")
    ]


def check(task: nn.Module, cp: int, mode: str, tp: int = 1) -> None:
    """ConfigError unless every transformers model in `task` can have its attention split over
    the sequence by context parallel."""
    for path, model in plans.models(task):
        name = path or type(model).__name__
        config = model.config.get_text_config()
        cls = type(model)
        if not getattr(cls, "_supports_attention_backend", False):
            refuse(cp, name, f"{cls.__name__}'s attention does not go through transformers' "
                   "attention functions, so it cannot be replaced by one that splits it")  # fmt: skip
        if "position_ids" not in inspect.signature(cls.forward).parameters:
            refuse(cp, name, f"{cls.__name__}.forward takes no position_ids to follow the split")
        if not (cls.__name__.endswith("ForCausalLM") or model is getattr(model, "base_model", 0)):
            refuse(cp, name, f"{cls.__name__} is not a causal LM: its head or loss would see only "
                   "this rank's chunks of each sequence")  # fmt: skip
        for key in ("sliding_window", "attn_logit_softcapping", "attention_dropout", "attn_pdrop"):
            if in_force(config, key):
                refuse(cp, f"{name}.config.{key}", f"{key}={getattr(config, key)} has no "
                       "context-parallel form here (full causal attention only)",
                       hint=f"Set the model's {key} to null (0 for dropout).")  # fmt: skip
        if not attention_modules(model):
            refuse(cp, name, f"{cls.__name__} has no attention module to split")
        heads = int(getattr(config, "num_attention_heads", 0)) // tp
        if mode == "ulysses" and heads % cp:
            raise ConfigError(
                "strategy.cp",
                cp,
                f"cp_mode=ulysses splits the heads over the cp ranks: {name} has {heads} "
                "attention heads per tensor-parallel rank, which cp does not divide",
                [d for d in range(1, heads + 1) if heads % d == 0],
                hint="Use cp_mode=ring or allgather, or a cp that divides the heads.",
            )


def in_force(config: Any, key: str) -> bool:
    """Whether the setting `key` changes attention from full causal softmax attention."""
    value = getattr(config, key, None)
    if key == "sliding_window":
        types = getattr(config, "layer_types", None)
        if types is not None:  # transformers 5: the layers' own kinds decide
            return any("sliding" in str(t) for t in types)
        return value is not None and getattr(config, "use_sliding_window", True) is not False
    return bool(value)


def refuse(cp: int, where: str, problem: str, hint: str | None = None):
    raise ConfigError(
        "strategy.cp",
        cp,
        f"context parallel cannot split the attention of the transformers model at {where}: "
        f"{problem}",
        [1],
        hint=hint or "Use strategy.cp=1 for this model.",
        near="",
    )


def attach(task: nn.Module, plan) -> None:
    """Give the transformers models in `task` the context plan `plan`
    (framework.parallel.context.ContextPlan): their attention modules take it, their attention goes
    through `attention`, their forward gets this rank's positions and labels."""
    found = plans.models(task)
    if not found:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)  # off the plan: SDPA's own masks
    for _, model in found:
        model.config._attn_implementation = NAME
        for _, module in attention_modules(model):
            module.context = plan
        model.register_forward_pre_hook(SplitInputs(plan), with_kwargs=True)


class SplitInputs:
    """A forward pre-hook of a transformers model: this rank's positions, shifted labels and
    label count while the plan is on (see the module docstring)."""

    def __init__(self, plan) -> None:
        self.plan = plan

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict):
        if not self.plan.active:
            return None
        signature = inspect.signature(module.forward)
        bound = signature.bind_partial(*args, **kwargs).arguments
        extra = [n for n, p in signature.parameters.items() if p.kind is p.VAR_KEYWORD]
        inputs = dict(bound.pop(extra[0], {}) if extra else {}, **bound)
        ids = inputs.get("input_ids")
        ids = ids if ids is not None else inputs["inputs_embeds"]
        if inputs.get("position_ids") is None:
            inputs["position_ids"] = self.plan.positions(ids.shape[1], ids.device).unsqueeze(0)
        mask = inputs.get("attention_mask")
        if mask is not None and (mask.dim() != 2 or not bool(mask.all())):
            raise ValueError(
                "context parallel splits whole sequences: an attention_mask that hides "
                "positions (padding) cannot be split; leave attention_mask out and set the "
                f"labels of padded positions to {IGNORE}"
            )
        inputs["attention_mask"] = ids.new_empty((1, 1, 0, 0), dtype=torch.bool)
        if "use_cache" in signature.parameters and inputs.get("use_cache") is None:
            inputs["use_cache"] = False  # a cache of the local chunks only
        labels = inputs.get("labels")
        if labels is not None and inputs.get("shift_labels") is None:
            inputs["shift_labels"], counted = next_labels(labels, self.plan)
            if inputs.get("num_items_in_batch") is None:
                inputs["num_items_in_batch"] = counted / self.plan.size
        return (), inputs


def next_labels(labels: torch.Tensor, plan) -> tuple[torch.Tensor, torch.Tensor]:
    """(The label of the next position of each of this rank's positions, the group's count of
    counted labels). Rank r holds chunks r and 2cp-1-r of n positions each: the head chunk's
    last position is followed by chunk r+1 (rank r+1's head, or this rank's tail when r is the
    last rank), the tail's by chunk 2cp-r (rank r-1's tail; none after the last chunk, rank 0's
    tail)."""
    size, rank = plan.size, plan.rank
    n = labels.shape[1] // 2
    rows = labels.shape[0]
    counted = (labels != IGNORE).sum()
    if rank == 0:  # the first position of a sequence is no position's next token
        counted = counted - (labels[:, 0] != IGNORE).sum()
    mine = torch.cat([labels[:, 0], labels[:, n], counted.view(1).to(labels.dtype)])
    every = mine.new_empty(size * mine.numel())
    dist.all_gather_into_tensor(every, mine.contiguous(), group=plan.group)
    every = every.view(size, -1)
    head_next = every[rank + 1, :rows] if rank + 1 < size else labels[:, n]
    tail_next = (
        every[rank - 1, rows : 2 * rows] if rank > 0 else torch.full_like(labels[:, 0], IGNORE)
    )
    shifted = torch.cat(
        [labels[:, 1:n], head_next[:, None], labels[:, n + 1 :], tail_next[:, None]], dim=1
    )
    return shifted, every[:, -1].sum().to(torch.float32)


def attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention function signature: (batch, heads, positions, head_dim) in,
    (batch, positions, heads, head_dim) out."""
    plan = getattr(module, "context", None)
    if plan is None or not plan.active:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
            is_causal=is_causal, **kwargs,
        )  # fmt: skip
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if dropout or kwargs.get("softcap") or kwargs.get("sliding_window"):
        raise ValueError("context-parallel attention has no dropout, soft cap or sliding window")
    d = query.shape[-1]
    if scaling is not None and not math.isclose(scaling * math.sqrt(d), 1.0):
        query = query * (scaling * math.sqrt(d))  # the kernels scale by 1/sqrt(head_dim)
    groups = query.shape[1] // key.shape[1]
    # grouped-query attention: ring and allgather send the key/value heads as they are (each
    # block's kernel repeats them where it needs to); ulysses splits the heads, so it needs
    # them repeated
    if groups > 1 and plan.mode == "ulysses":
        key, value = (t.repeat_interleave(groups, dim=1) for t in (key, value))
    out = plan.attention(query, key, value, causal=causal)
    return out.transpose(1, 2).contiguous(), None
