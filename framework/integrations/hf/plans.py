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

# transformers' style -> the framework's (framework.parallel.tensor.style) with the same layouts in and
# out, the same split of the weights and the same gradients; a style not here (nor in WHOLE) is
# refused before launch rather than applied approximately
STYLES = {
    "colwise": "colwise",
    "rowwise": "rowwise",
    "colwise_gather_output": "colwise_gather",  # an LM head: logits gathered whole
    "colwise_rep": "colwise_gather",  # the same layouts under another name
    "embedding_rowwise": "rowwise_embedding",  # split over the vocabulary, output all-reduced
    "embedding_colwise": "colwise_gather",  # torch's colwise splits an embedding's hidden dim
    "rowwise_split_input": "rowwise_from_replicated",  # a whole input, sliced on each rank
    "rowwise_rep": "rowwise_from_replicated",
    "sequence_parallel": "sequence",
    "replicated_with_grad_allreduce": "replicated_grad_sum",  # Qwen3's per-head q/k norms
}
WHOLE = ("replicate",)  # every rank keeps the module whole: nothing to apply
# under sequence parallel: the styles of the linears inside a decoder layer's attention and MLP
IN_LAYER = {
    "colwise": "colwise",  # its input gathered from the sequence by its parent
    "replicated_grad_sum": "replicated_grad_sum",
    "rowwise": "rowwise_scatter_sequence",  # reduce-scattered back over the sequence
}
HEAD = {
    "colwise_gather": "colwise_gather_from_sequence",
    "colwise_sharded_logits": "colwise_sharded_logits_from_sequence",
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


def framework_style(style: str, module: str, is_module: bool = True) -> str | None:
    """The framework's name for a transformers style (None: the module stays whole), or a
    ConfigError naming both (a style given to a parameter rather than a module is never
    applied)."""
    if style in WHOLE:
        return None
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


def heads(task: nn.Module) -> list[str]:
    """Names in the task of the modules with parameters that its transformers models hold outside
    their base model (the LM head), or of a base model held alone."""
    found: list[str] = []
    for path, model in models(task):
        base = getattr(model, "base_model", model)
        if base is model:
            found.append(path)
            continue
        inner = {id(m) for m in base.modules()}
        for name, module in model.named_modules():
            if id(module) not in inner and name and _has_weights(module, recurse=False):
                found.append(_join(path, name))
    return found


def loss_plan(task: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """The `plan` with the LM heads' logits left split over the vocabulary (torch's
    loss_parallel computes transformers' cross-entropy on them without gathering them)."""
    return {
        k: "colwise_sharded_logits" if v == "colwise_gather" and k in heads(task) else v
        for k, v in plan.items()
    }


def input_plan(task: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """The `plan` with the attention and MLP of each decoder layer (a child holding only
    column/row-split linears and per-head norms, two column-split or more) taking their input as
    one replicated DTensor: the input gradients of their column-split linears (q, k, v; gate,
    up) add up into one partial sum, all-reduced once per module rather than once per linear
    (profiled: 405 against 225 collectives in 5 steps of a 4-layer Llama against the
    framework's gpt, whose q, k, v and MLP input are each one linear)."""
    out = dict(plan)
    for path, model in models(task):
        base = getattr(model, "base_model", model)
        base_path = next(_join(path, n) for n, m in model.named_modules() if m is base)
        classes = set(getattr(model, "_no_split_modules", None) or ())
        for name, layer in base.named_modules():
            if type(layer).__name__ not in classes:
                continue
            for child, _ in layer.named_children():
                full = f"{_join(base_path, name)}.{child}"
                inside = [v for k, v in plan.items() if k.startswith(f"{full}.")]
                if inside.count("colwise") > 1 and set(inside) <= IN_LAYER.keys():
                    out[full] = "replicate_input"
    return out


def sequence_plan(
    task: nn.Module, plan: dict[str, str], whole: tuple[str, ...] | list[str] = ()
) -> dict[str, str]:
    """The tensor-parallel `plan` ({module: framework style}) of the task's transformers models
    made sequence parallel: the residual stream between decoder layers is split over the
    sequence. The first layer keeps its positions of the hidden states; each layer's norms run on
    them; its attention and MLP gather them (all-gather) and give them back split (the row-split
    linear reduce-scatters instead of all-reducing); the final norm runs on them and the head
    gathers them. Positions, rotary embeddings and masks are made from the whole sequence, as
    before the layers. A module of a layer that every tensor-parallel rank runs whole (`whole`:
    the MoE blocks whose experts ep splits) runs on the whole sequence, gathered, and hands on
    this rank's positions of its output. A ConfigError names a module this does not cover."""
    out = dict(plan)
    for path, model in models(task):
        base = getattr(model, "base_model", model)
        base_path = next(_join(path, n) for n, m in model.named_modules() if m is base)
        layers = _decoder_layers(model, base, base_path)
        out[layers[0][0]] = "split_sequence_input"
        for name, layer in layers:
            for child_name, child in layer.named_children():
                full = f"{name}.{child_name}"
                if full in whole:
                    out[full] = "gather_sequence_whole"
                    continue
                out.update(_in_layer(full, child, plan, task))
        in_base = [f"{base_path}.{n}" if base_path else n for n, _ in base.named_children()]
        for name in in_base:
            module = task.get_submodule(name)
            if name == layers[0][0].rpartition(".")[0]:  # the list of decoder layers
                continue
            if _is_norm(module):
                out[name] = "sequence"
            elif _has_weights(module) and not isinstance(module, nn.Embedding):
                refuse_sequence(name, "holds weights beside the decoder layers")
        if base is model:
            refuse_sequence(path or type(model).__name__, "has no head to gather the sequence")
    for name in heads(task):
        if plan.get(name) not in HEAD and not any(k.startswith(f"{name}.") for k in plan):
            refuse_sequence(
                name, "is a head its plan does not split (it would see only this rank's positions)"
            )
        if plan.get(name) in HEAD:
            out[name] = HEAD[plan[name]]
    return out


def _decoder_layers(model: nn.Module, base: nn.Module, base_path: str):
    """[(name in the task, layer)] of the base model's decoder layers (its `_no_split_modules`),
    which must be the items of one list in the base model."""
    classes = set(getattr(model, "_no_split_modules", None) or ())
    layers = [
        (_join(base_path, n), m) for n, m in base.named_modules() if type(m).__name__ in classes
    ]
    parents = {name.rpartition(".")[0] for name, _ in layers}
    if not layers or len(parents) != 1 or parents.pop().count(".") != base_path.count(".") + 1:
        refuse_sequence(base_path, "has no single list of decoder layers (_no_split_modules)")
    return layers


def _in_layer(name: str, child: nn.Module, plan: dict[str, str], task: nn.Module):
    """The sequence-parallel styles of one child of a decoder layer and of its split modules."""
    inside = {k: v for k, v in plan.items() if k.startswith(f"{name}.")}
    if name in plan:
        refuse_sequence(name, f"is split whole ({plan[name]}) inside a decoder layer")
    if inside:
        for k, v in inside.items():
            if v not in IN_LAYER:
                given = _given_style(task, k)
                refuse_sequence(
                    k,
                    f"has the style '{given}' in its plan (the framework's {v}), which has no "
                    "sequence-parallel form inside a decoder layer (only colwise, rowwise and "
                    "replicated_with_grad_allreduce have one)",
                )
        return {name: "gather_sequence_input", **{k: IN_LAYER[v] for k, v in inside.items()}}
    if _is_norm(child):
        return {name: "sequence"}
    if _has_weights(child):
        refuse_sequence(name, "holds weights that its plan does not split")
    return {}


def _given_style(task: nn.Module, name: str) -> str:
    """The style the task's transformers plans give module `name` (as written there)."""
    from framework.parallel.keys import matches

    found = [style for key, style in plan_patterns(task).items() if matches(key, name)]
    return found[-1] if found else "?"


def _has_weights(module: nn.Module, recurse: bool = True) -> bool:
    return next(module.parameters(recurse=recurse), None) is not None


def _is_norm(module: nn.Module) -> bool:
    """A module with weights, all one-dimensional (a norm), and no children."""
    params = list(module.parameters())
    return bool(params) and all(p.dim() == 1 for p in params) and not any(module.children())


def refuse_sequence(module: str, problem: str):
    raise ConfigError(
        "strategy.sequence_parallel",
        True,
        f"the transformers model's module {module} {problem}, which sequence parallel does not "
        "split over the sequence",
        ["false"],
        near="",
    )


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path and name else path or name


def tensor_plan(
    model: nn.Module,
    skip: tuple[str, ...] | list[str] = (),
    sequence_parallel: bool = False,
    loss_parallel: bool = False,
    experts: tuple[str, ...] | list[str] = (),
) -> dict[str, str]:
    """{module name: framework style} from the plans of the transformers models in `model`, for
    each module of theirs a pattern names (wildcards expanded to real names, so an entry of
    `strategy.tp_plan` for one layer replaces exactly that layer's), but those `skip` names and
    what is inside the MoE blocks expert parallel splits instead (`experts`: their paths, and
    every block already swapped for a framework layer; tensor-parallel ranks hold the same
    tokens, so they keep these experts whole); sequence parallel and loss parallel as
    `sequence_plan` and `loss_plan` make them. A transformers style the framework cannot
    apply is a ConfigError naming it and the module."""
    from framework.nn.moe import ExpertDispatch
    from framework.parallel.keys import matches

    swapped = [n for n, m in model.named_modules() if isinstance(m, ExpertDispatch)]
    whole = tuple(f"{p}." for p in (*experts, *swapped))

    patterns = plan_patterns(model)
    if not patterns:
        if sequence_parallel and models(model):  # e.g. GPT-2: transformers gives it no plan
            refuse_sequence(models(model)[0][0], "has no tensor-parallel plan of its own")
        return {}
    plan: dict[str, str] = {}
    modules = [name for name, _ in model.named_modules() if name]
    # a parameter too: some families' plans split one (packed experts), which torch's styles,
    # applied to modules, cannot do
    names = [*modules, *(name for name, _ in model.named_parameters())]
    whole_modules = set(modules)
    for name in names:
        if any(matches(p, name) for p in skip) or f"{name}.".startswith(whole):
            continue
        for pattern, transformers_style in patterns.items():
            if matches(pattern, name):
                found = framework_style(transformers_style, name, name in whole_modules)
                if found:
                    plan[name] = found
    if loss_parallel:
        plan = loss_plan(model, plan)
    if sequence_parallel:  # the MoE blocks ep splits run whole on every tp rank
        return sequence_plan(model, plan, [p.rstrip(".") for p in whole])
    return input_plan(model, plan)
