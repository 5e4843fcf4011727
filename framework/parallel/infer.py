"""A tensor-parallel plan inferred from a model's structure, for a model that declares none.

The model is called on made-up inputs on the meta device (framework/parallel/trace.py records
where each linear layer's output goes). Linears whose outputs reach other linears only through
calls that keep their features split are grouped: those feeding are split by columns, those fed
by rows, one all-reduce after each group. This finds a Megatron MLP (the first linear, an
activation, the second; a gated MLP's gate and up projections together) and attention (query,
key and value projections through heads and attention to the output projection: a head's
features stay on one rank only when the code reshapes with -1 heads and the heads divide by tp).
Each `nn.Embedding` whose rows divide by tp is split over them; a linear left out of every group
with more outputs than inputs and no linear after it (an LM head) is split by columns, its output
gathered.

The modules a family of standard layers plans itself (torch's transformer layers,
framework/integrations/torch_nn.py: `known`) are left to it; a model whose family declares its
own plans (framework.nn blocks, a transformers model's `tp_plan`) is not inferred at all.
"""

from __future__ import annotations

import inspect
import logging
import re
from dataclasses import dataclass, field

import torch
from torch import nn

from framework.parallel.keys import matches
from framework.parallel.trace import EMBEDDING, LINEAR, PLANNED, Record, trace

log = logging.getLogger("framework.parallel")
BATCH, LENGTH = 2, 8  # the made-up inputs: 2 sequences of 8 positions


@dataclass
class Inferred:
    """An inferred plan: {module name: framework style}, and the linears left whole, with why."""

    plan: dict[str, str] = field(default_factory=dict)
    whole: dict[str, str] = field(default_factory=dict)


def plan_for(task: nn.Module, tp: int) -> Inferred:
    """The inferred plan of `task` over `tp` ranks: empty when one of its model families declares
    its own plans; else the plan of the modules its standard-layer families leave (see module
    docstring)."""
    from framework.parallel.model import adapter_for

    adapter = adapter_for(task)
    if adapter.declares_plan(task):
        return Inferred()
    return infer_plan(task, tp, known=list(adapter.tensor_plan(task)))


def infer_plan(model: nn.Module, tp: int, known: list[str] | tuple = ()) -> Inferred:
    """The plan inferred from `model`'s structure over `tp` ranks, leaving alone the modules
    `known` names (a plan of their own) and everything inside them."""
    weights = _weights(model, tuple(known))
    record = Record()
    _trace_tree(model, "", weights, tp, record)
    return _solve(model, record, tp, weights)


def _weights(model: nn.Module, known: tuple[str, ...]) -> dict[int, tuple[str, str]]:
    """id of each linear and embedding weight -> (module name, kind); inside a known module:
    PLANNED. A weight tied between an embedding and a linear is the linear's."""
    found: dict[int, tuple[str, str]] = {}
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor):
            continue
        if any(name == k or name.startswith(f"{k}.") for k in known):
            found[id(weight)] = (name, PLANNED)
        elif isinstance(module, nn.Linear):
            found[id(weight)] = (name, LINEAR)
        elif isinstance(module, nn.Embedding):
            found.setdefault(id(weight), (name, EMBEDDING))
    return found


def _trace_tree(module: nn.Module, prefix: str, weights, tp: int, record: Record) -> None:
    """Trace `module` on made-up inputs; where its forward cannot run on them (other inputs, a
    value read from a tensor, no forward of its own), trace its children instead. Children a
    successful trace never called are traced on their own."""
    names = _splittable(module, prefix, weights)
    if not names or isinstance(module, (nn.Linear, nn.Embedding)):
        return  # alone, a layer says nothing of where its output goes
    inputs = example_inputs(module)
    if inputs is not None:
        try:
            found = trace(module, inputs, weights, tp)
        except Exception as err:  # noqa: BLE001 - any forward: its parts are tried instead
            log.debug("Tensor-parallel inference: %s not traced (%s)", prefix or "model", err)
        else:
            record.merge(found)
            for name, child in module.named_children():
                full = f"{prefix}.{name}" if prefix else name
                if not _splittable(child, full, weights) & found.called:
                    _trace_tree(child, full, weights, tp, record)
            return
    for name, child in module.named_children():
        _trace_tree(child, f"{prefix}.{name}" if prefix else name, weights, tp, record)


def _splittable(module: nn.Module, prefix: str, weights) -> set[str]:
    """Names of the linears and embeddings in `module` that a plan could split."""
    found = set()
    for name, m in module.named_modules(prefix=prefix):
        entry = weights.get(id(getattr(m, "weight", None)))
        if entry is not None and entry[1] != PLANNED and entry[0] == name:
            found.add(name)
    return found


def example_inputs(module: nn.Module) -> list[torch.Tensor] | None:
    """Made-up meta inputs for `module`'s forward: token ids when its first weight is an
    embedding's, else features of the size its first weight takes; as many as the forward has
    required positional arguments (at least one). None: no input can be made up."""
    first = next((m for m in module.modules() if next(m.parameters(False), None) is not None), None)
    if first is None:
        return None
    if isinstance(first, nn.Embedding):
        x = torch.zeros(BATCH, LENGTH, dtype=torch.long, device="meta")
    else:
        weight = getattr(first, "weight", None)
        if isinstance(first, nn.Linear):
            features = first.in_features
        elif isinstance(first, nn.MultiheadAttention):
            features, weight = first.embed_dim, first.out_proj.weight
        elif isinstance(weight, torch.Tensor) and weight.dim() == 1:  # a norm
            features = weight.shape[0]
        else:
            return None
        x = torch.zeros(BATCH, LENGTH, features, dtype=weight.dtype, device="meta")
    return [x] * _positional(module)


def _positional(module: nn.Module) -> int:
    try:
        params = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return 1
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    required = [p for p in params if p.kind in kinds and p.default is inspect.Parameter.empty]
    return max(1, len(required))


def _solve(model: nn.Module, record: Record, tp: int, weights) -> Inferred:
    modules = dict(model.named_modules())
    result, taken = Inferred(), set()
    for first in record.order:
        if first in taken or not record.consumers.get(first):
            continue
        cols, rows = _group(first, record)
        problem = _problem(cols, rows, record, modules, tp, taken)
        if problem:
            result.whole.update({c: problem for c in sorted(cols - taken)})
            continue
        result.plan.update({c: "colwise" for c in cols} | {r: "rowwise" for r in rows})
        taken |= cols | rows
    for name in record.order:  # heads: split by columns, their output gathered
        linear = modules[name]
        wider = linear.out_features > linear.in_features
        last = not record.feeds.get(name)  # no linear after it
        if name not in taken and wider and last and linear.out_features % tp == 0:
            result.plan[name] = "colwise_gather"
            result.whole.pop(name, None)
    for name in record.order:
        if name not in result.plan and name in record.news:
            result.whole.setdefault(name, f"{name}'s output cannot stay split: {record.cut[name]}")
    _embeddings(model, modules, record, tp, weights, result)
    order = {name: i for i, name in enumerate(modules)}
    result.plan = dict(sorted(result.plan.items(), key=lambda item: order[item[0]]))
    return result


def _group(first: str, record: Record) -> tuple[set[str], set[str]]:
    """The linears split by columns with `first` (all that feed the same linears) and those
    split by rows (all they feed)."""
    cols, rows = {first}, set()
    while True:
        new_rows = set().union(*(record.consumers.get(c, set()) for c in cols))
        new_cols = cols.union(*(record.inputs.get(r, set()) for r in new_rows))
        if (new_cols, new_rows) == (cols, rows):
            return cols, rows
        cols, rows = new_cols, new_rows


def _problem(cols, rows, record: Record, modules, tp: int, taken: set[str]) -> str | None:
    """Why the group cannot be split (None: it can)."""
    for name in sorted(cols):
        if name in record.cut:
            return f"{name}'s output cannot stay split: {record.cut[name]}"
    if cols & rows:
        return f"{sorted(cols & rows)[0]} would be split both by columns and by rows"
    if (cols | rows) & taken:
        return f"{sorted((cols | rows) & taken)[0]} is split in another group already"
    for name in sorted(cols):
        if modules[name].out_features % tp:
            return f"{name}'s {modules[name].out_features} outputs do not divide by tp={tp}"
    for name in sorted(rows):
        if modules[name].in_features % tp:
            return f"{name}'s {modules[name].in_features} inputs do not divide by tp={tp}"
    return None


def _embeddings(model, modules, record: Record, tp: int, weights, result: Inferred) -> None:
    """Every embedding split over its rows when they divide by tp and its weight is used only
    by it, or by a linear (a tied head) split by columns alike."""
    holders: dict[int, list[str]] = {}
    for name, module in modules.items():
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor):
            holders.setdefault(id(weight), []).append(name)
    for name, module in modules.items():
        if not isinstance(module, nn.Embedding) or name in record.other_uses:
            continue
        entry = weights.get(id(module.weight))
        if entry is None or entry[1] == PLANNED or module.num_embeddings % tp:
            continue
        tied = [n for n in holders[id(module.weight)] if n != name]
        if any(result.plan.get(n) not in ("colwise", "colwise_gather") for n in tied):
            continue  # a tied linear split otherwise, or whole: the shared weight would differ
        result.plan[name] = "rowwise_embedding"


def collapsed(plan: dict[str, str], model: nn.Module) -> list[str]:
    """'module:style' entries, layer numbers written * where every module the pattern names in
    `model` has the same style (so the entries, copied into strategy.tp_plan, split the same
    modules)."""
    names = [n for n, _ in model.named_modules() if n]
    out: dict[str, str] = {}
    for name, style in plan.items():
        pattern = re.sub(r"\.\d+(?=\.|$)", ".*", name)
        named = [n for n in names if matches(pattern, n)]
        same = all(plan.get(n) == style for n in named)
        key = pattern if same else name
        out.setdefault(key, style)
    return [f"{k}:{v}" for k, v in out.items()]


def describe(inferred: Inferred, model: nn.Module) -> str:
    """The plan as a strategy.tp_plan override a user can copy."""
    return f"strategy.tp_plan=[{','.join(collapsed(inferred.plan, model))}]"


def whole_reasons(inferred: Inferred, limit: int = 4) -> list[str]:
    """The first reasons linears were left whole (for the log), each once, layer numbers as *."""
    found = [re.sub(r"\.\d+(?=[.'\s]|$)", ".*", why) for why in inferred.whole.values()]
    return list(dict.fromkeys(found))[:limit]
