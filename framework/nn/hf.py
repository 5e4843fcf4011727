"""transformers models (>= 5) held in a task: the parallel plans they declare themselves.

A transformers model carries its tensor-parallel plan (`model.tp_plan`: the class's own entries,
e.g. the LM head, merged by transformers with its config's `base_model_tp_plan` under the base
model's prefix) and its unsplittable blocks (`_no_split_modules`: the decoder layer class). The
parallel core reads them here, as it reads `tp_plan()` from framework.nn blocks (DESIGN.md,
decision 6): nobody writes a plan per model family. transformers is never imported here: a task
that holds one of its models has imported it already.
"""

from __future__ import annotations

import sys

from torch import nn

from framework.errors import ConfigError

# transformers' style -> the framework's (framework.nn.plan.style) with the same torch
# ParallelStyle; a style not here is refused before launch rather than applied approximately
STYLES = {
    "colwise": "colwise",
    "rowwise": "rowwise",
    "colwise_gather_output": "colwise_gather",  # an LM head: logits gathered whole
    "embedding_rowwise": "rowwise_embedding",  # split over the vocabulary, output all-reduced
}
KINDS = {"num_attention_heads": "attention heads", "num_key_value_heads": "key/value heads"}


def models(task: nn.Module) -> list[tuple[str, nn.Module]]:
    """(path in the task, model) of each outermost transformers `PreTrainedModel` in `task`;
    the inner ones (a base model inside a CausalLM) are covered by their outer model's plan."""
    transformers = sys.modules.get("transformers")
    if transformers is None:
        return []
    found: list[tuple[str, nn.Module]] = []
    for name, module in task.named_modules():
        inside = any(not path or name.startswith(f"{path}.") for path, _ in found)
        if not inside and isinstance(module, transformers.PreTrainedModel):
            found.append((name, module))
    return found


def plan_patterns(task: nn.Module) -> dict[str, str]:
    """{module pattern in the task (* for layer numbers): transformers style} from the plans of
    the task's transformers models."""
    patterns: dict[str, str] = {}
    for path, model in models(task):
        own = getattr(model, "tp_plan", None)  # transformers 5: class and config plans merged
        for key, style in (own if isinstance(own, dict) else {}).items():
            patterns[f"{path}.{key}" if path else key] = style
    return patterns


def framework_style(style: str, module: str, is_module: bool = True) -> str:
    """The framework's name for a transformers style, or a ConfigError naming both (a style
    given to a parameter rather than a module is never applied)."""
    if style in STYLES and is_module:
        return STYLES[style]
    what = "" if is_module else " (a parameter: the framework splits modules)"
    raise ConfigError(
        "strategy.tp_plan",
        f"{module}:{style}",
        f"the transformers model's own plan splits {module}{what} with style '{style}', which "
        "the framework does not apply",
        list(STYLES),
        hint=f"Give the module a framework style (e.g. 'strategy.tp_plan=[{module}:colwise]') "
        "if one is exact for it, or use a strategy without tensor parallelism (tp=1).",
        near="",
    )


def no_split_classes(task: nn.Module) -> tuple[str, ...]:
    """Class names of the blocks the task's transformers models say must stay whole (their
    `_no_split_modules`: the decoder layers), the natural FSDP units."""
    names: set[str] = set()
    for _, model in models(task):
        names.update(getattr(model, "_no_split_modules", None) or ())
    return tuple(sorted(names))


def check_heads(task: nn.Module, tp: int) -> None:
    """Attention heads and key/value heads divide by `tp`. transformers' attention reshapes a
    projection with view(..., -1, head_dim), so a column-split q/k/v gives each rank its own whole
    heads only when the heads split evenly; otherwise a head would be cut in two."""
    for path, model in models(task):
        text = getattr(model.config, "get_text_config", None)  # a composite's language model
        config = text() if text else model.config
        heads = getattr(config, "num_attention_heads", None)
        for key in ("num_attention_heads", "num_key_value_heads"):
            value = getattr(config, key, None) or heads
            if isinstance(value, int) and value % tp:
                raise ConfigError(
                    ".".join(p for p in (path, "config", key) if p),
                    value,
                    f"{type(model).__name__}'s attention splits whole heads over the tensor-"
                    f"parallel ranks, and its {value} {KINDS[key]} do not divide by "
                    f"strategy.tp={tp}",
                    hint="Use a tp that divides both num_attention_heads and "
                    "num_key_value_heads, or another strategy.",
                )
