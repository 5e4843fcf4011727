"""Pipeline stages and the loss of a transformers causal LM, read from the model's own `pp_plan`.

transformers (>= 5) says how its models pipeline: the config's `base_model_pp_plan` names the
base model's children in order (Llama: embed_tokens -> layers -> norm) and the class's
`_pp_plan` the head applied to the base model's output (lm_head). The layer chain here follows
it: the entries before the decoder layers' ModuleList are the first layer (the embedding), each
decoder layer is a layer, the entries after it are the last layer (final norm + head). A decoder
layer needs what the base model's forward gives it besides the hidden states (positions, their
rotary embeddings, the causal mask of its attention type): only hidden states travel between
stages, so each decoder layer makes them again, as the base model makes them (transformers'
own mask builder, its rotary module). Nothing is written per model family, and no module or
parameter is renamed. transformers is never imported at module level (see plans.py).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from framework.errors import ConfigError
from framework.integrations.hf import plans
from framework.integrations.hf.context_parallel import next_labels
from framework.parallel.context import IN_FORCE

IGNORE_INDEX = -100  # transformers' label for a position without a loss


def find(task: nn.Module) -> tuple[str, nn.Module] | None:
    """(path in the task, model) of the task's first transformers model with a pipeline plan."""
    for path, model in plans.models(task):
        if getattr(model, "pp_plan", None):
            return path, model
    return None


def ordered_plan(model: nn.Module) -> list[str]:
    """Module names (relative to `model`) of its pipeline plan in running order: the base
    model's entries in the config's order, then the head's (they take the base model's output).
    transformers merges them head first, so the order is restored here."""
    plan = list(model.pp_plan)
    base = model.base_model
    if base is model:
        return plan
    prefix = f"{model.base_model_prefix}."
    return [n for n in plan if n.startswith(prefix)] + [n for n in plan if not n.startswith(prefix)]


def pipeline_layers(model: nn.Module) -> list[tuple[tuple[str, ...], Callable[[Any], Any]]]:
    """[(module names relative to `model`, run)] in order: embedding, each decoder layer, final
    norm + head (ValueError when the plan is not such a chain)."""
    names = ordered_plan(model)
    lists = [n for n in names if isinstance(model.get_submodule(n), nn.ModuleList)]
    if len(lists) != 1 or lists[0] in (names[0], names[-1]):
        raise ValueError(
            f"{type(model).__name__}'s pp_plan ({', '.join(names)}) is not an embedding, one "
            "list of decoder layers and a head: the framework cannot cut it into stages"
        )
    where = names.index(lists[0])
    first, last = names[:where], names[where + 1 :]
    decoder = model.get_submodule(lists[0])
    base = model.base_model
    chain = [(tuple(first), _in_order(model, first))]
    for i, layer in enumerate(decoder):
        chain.append(((f"{lists[0]}.{i}",), _DecoderLayer(base, layer, i)))
    chain.append((tuple(last), _in_order(model, last)))
    return chain


def _in_order(model: nn.Module, names: list[str]) -> Callable[[Any], Any]:
    modules = [model.get_submodule(n) for n in names]

    def run(x):
        for module in modules:
            x = module(x)
        return x

    return run


class _DecoderLayer:
    """One decoder layer as a function of the hidden states: the positions (0..T-1, as the
    base model takes them without a cache), their rotary embeddings from the base model's own
    rotary module, and the mask of the layer's attention type from transformers' mask builder
    (None for a plain causal mask under sdpa: the same call the base model's forward makes).
    Under context parallel (the layer's attention holds a plan that is on) the hidden states
    are this rank's zigzag chunks: their positions are the plan's, and no mask is made (the
    split attention is causal by construction; see context_parallel.py)."""

    def __init__(self, base: nn.Module, layer: nn.Module, index: int) -> None:
        self.base, self.layer, self.index = base, layer, index

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_masks_for_generate

        plan = context_plan(self.layer)
        if plan is not None and plan.active:
            positions = plan.positions(hidden.shape[1], hidden.device).unsqueeze(0)
            mask = None
        else:
            positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
            mask = create_masks_for_generate(self.base.config, hidden, None, None, positions)
        if isinstance(mask, dict):  # one mask per attention type (full, sliding)
            mask = mask[self.base.config.get_text_config().layer_types[self.index]]
        kwargs = {"attention_mask": mask, "position_ids": positions}
        rotary = getattr(self.base, "rotary_emb", None)
        if rotary is not None:
            kwargs["position_embeddings"] = rotary(hidden, positions)
        out = self.layer(hidden, **kwargs)
        return out[0] if isinstance(out, tuple) else out


def context_plan(layer: nn.Module):
    """The context plan its attention holds (framework.parallel.context.ContextPlan), or None."""
    return next((m.context for m in layer.modules() if getattr(m, "context", None)), None)


def check_loss(path: str, model: nn.Module, pp: int) -> None:
    """A ConfigError when transformers adds to `model`'s causal-LM loss what the last stage
    cannot compute: a MoE model's auxiliary load-balancing loss (`output_router_logits` with a
    non-zero `router_aux_loss_coef`), which needs every layer's router logits while only hidden
    states travel between stages."""
    config = model.config.get_text_config()
    if getattr(config, "output_router_logits", False) and getattr(
        config, "router_aux_loss_coef", 0.0
    ):
        key = ".".join(p for p in (path, "config", "output_router_logits") if p)
        raise ConfigError(
            key,
            True,
            f"{type(model).__name__} adds its routers' auxiliary loss (router_aux_loss_coef="
            f"{config.router_aux_loss_coef}) to the loss, from the router logits of every layer; "
            f"under a pipeline (strategy.pp={pp}) the last stage computes the loss from the "
            "hidden states alone and would leave it out",
            ["false"],
            near="",
            hint="Set output_router_logits=false (or router_aux_loss_coef=0) for pipeline "
            "training, or use pp=1.",
        )


def is_causal_lm(model: nn.Module) -> bool:
    """Whether transformers computes `model`'s loss as a causal LM's (shifted next-token
    cross-entropy), the loss the framework supplies under a pipeline."""
    return getattr(model, "loss_type", None) == "ForCausalLM"


class CausalLMLoss:
    """The model's own loss function (transformers' ForCausalLMLoss: labels shifted by one,
    -100 ignored) on the last stage, normalised by the valid tokens of the whole batch: a
    pipeline's microbatches then add up to exactly the one-process loss of the batch, also when
    they hold different numbers of ignored labels.

    Under context parallel (a plan in force, framework.parallel.context) the labels are this rank's
    zigzag chunks: each position's next label comes from `context_parallel.next_labels` (the chunk
    boundaries' from the neighbouring chunks' owners), and the count is the cp group's over cp,
    so the mean over the cp ranks (FSDP's gradient average) is the whole sequences' mean."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.parts = 1
        self.tokens: torch.Tensor | None = None

    def begin(self, labels: torch.Tensor, parts: int) -> None:
        """Before a batch cut into `parts` microbatches (each one's loss is divided by `parts`
        afterwards): count the labels that take part in the loss."""
        self.parts = parts
        plan = split_plan()
        if plan is None:
            self.tokens = (labels[..., 1:] != IGNORE_INDEX).sum().clamp(min=1)
        else:
            self.tokens = next_labels(labels, plan)[1].clamp(min=1) / plan.size

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.tokens is None:
            self.begin(labels, 1)
        plan = split_plan()
        loss = self.model.loss_function(
            logits=logits,
            labels=labels,
            vocab_size=self.model.config.get_text_config().vocab_size,
            num_items_in_batch=self.tokens,
            shift_labels=None if plan is None else next_labels(labels, plan)[0],
        )
        return loss * self.parts


def split_plan():
    """The context plan in force when it splits sequences (cp > 1), else None."""
    plan = IN_FORCE.get()
    return plan if plan is not None and plan.size > 1 else None


def split_batch(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels) of a causal LM's batch: a tensor of token ids is both, a dict gives
    `input_ids` and `labels` (default: the input ids). Only hidden states travel between
    stages, so a padding mask cannot reach the decoder layers: a batch whose `attention_mask`
    masks a position is refused (label padding -100 instead, or pack the sequences)."""
    if isinstance(batch, torch.Tensor):
        return batch, batch
    if isinstance(batch, dict) and "input_ids" in batch:
        mask = batch.get("attention_mask")
        if mask is not None and not bool(mask.all()):
            raise ValueError(
                "a batch's attention_mask masks some positions, which pipeline stages cannot "
                "pass on: leave attention_mask out and set the labels of padded positions to "
                "-100 (right padding), or pack the sequences"
            )
        return batch["input_ids"], batch.get("labels", batch["input_ids"])
    raise ValueError(
        "a transformers causal LM's batch, under a pipeline, is a tensor of token ids or a dict "
        f"with input_ids (and labels), not {type(batch).__name__}"
    )


def describe(path: str, model: nn.Module) -> str | None:
    """What a layer count of the model is made of (for messages), None if it is not a
    transformers model."""
    transformers = sys.modules.get("transformers")
    if transformers is None or not isinstance(model, transformers.PreTrainedModel):
        return None
    key = ".".join(p for p in (path, "config", "num_hidden_layers") if p)
    n = getattr(model.config.get_text_config(), "num_hidden_layers", "?")
    return (
        f"{type(model).__name__}: its {n} decoder layers ({key}={n}), its embedding and its "
        "final norm + head"
    )
