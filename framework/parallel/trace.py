"""Where the output of each linear layer goes: one forward pass on the meta device, recorded.

`trace(module, example, weights, tp)` calls the module on made-up inputs under a
`TorchFunctionMode`, which sees every torch call as the model's code makes it (`x.view(b, t, -1,
d)` with its -1, `F.scaled_dot_product_attention`, `F.linear` with the layer's weight). Every
tensor is replaced by a meta tensor of its shape before a call runs, so nothing is computed,
nothing is allocated and no weight or buffer of the model changes. A value read out of a meta
tensor (`.item()`, `bool(mask == causal).all()`) reads as zero or False: a check of the data
(is the mask causal, is there padding) takes its general path.

A tensor made from the outputs of linear layers carries a `Flow`: which linears, and which of its
dimensions holds their output features. Were those linears split by columns, exactly that
dimension would hold only this rank's part, and the rules below follow it through each call:
elementwise functions, reshapes that keep whole groups of features together (attention heads:
the number of groups must divide by tp, and the code must leave their count to the tensor, -1),
transposes, attention over a batch or head dimension, a softmax over another dimension. A call
that needs every feature (a norm over them, a sum, a reshape that cuts a head) "cuts" the flow:
those linears' outputs must stay whole. A flow that reaches the input of another linear, on its
last dimension, pairs them (the first split by columns, the second by rows).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

LINEAR, EMBEDDING, PLANNED = "linear", "embedding", "planned"  # kinds of a known weight
# calls that act on each element alone: a split dimension stays split
UNARY = {
    "abs", "alpha_dropout", "bfloat16", "celu", "clone", "contiguous", "cos", "detach",
    "double", "dropout", "elu", "erf", "exp", "feature_alpha_dropout", "float", "gelu",
    "half", "hardsigmoid", "hardswish", "hardtanh", "leaky_relu", "log", "logsigmoid", "mish",
    "neg", "pos", "reciprocal", "relu", "relu6", "rsqrt", "selu", "sigmoid", "sign", "silu",
    "sin", "softplus", "sqrt", "square", "tanh", "to", "type", "type_as", "dropout1d",
    "dropout2d", "dropout3d", "nan_to_num", "threshold",
}  # fmt: skip
# elementwise calls of several tensors, broadcast against each other
BROADCAST = {
    "add", "sub", "mul", "div", "pow", "where", "masked_fill", "maximum", "minimum", "lerp",
    "addcmul", "addcdiv", "clamp", "clip", "fmod", "remainder",
}  # fmt: skip
# calls that read values out of a tensor (meta tensors have none: see _read)
READS = {"item", "tolist", "__bool__", "__int__", "__index__", "__float__", "equal", "allclose"}
READS |= {"is_nonzero"}
RENAMED = {"truediv": "div", "radd": "add", "rsub": "sub", "rmul": "mul", "rtruediv": "div"}
RENAMED |= {"rpow": "pow", "rmatmul": "matmul", "iadd": "add", "isub": "sub", "imul": "mul"}
RENAMED |= {"itruediv": "div", "swapaxes": "transpose", "swapdims": "transpose"}
RENAMED |= {"concat": "cat", "concatenate": "cat", "clip": "clamp", "mT": "mt", "T": "t"}


class Cut(Exception):
    """The flow cannot stay split through this call (the message says why). `natural`: where a
    block's output ends as it should (added to the residual stream, normalised, returned),
    which is no news to the user."""

    def __init__(self, why: str, natural: bool = False) -> None:
        super().__init__(why)
        self.natural = natural


@dataclass(frozen=True)
class Flow:
    """What a traced tensor is made of: the linears whose output features it holds (since the
    last linear), in dimension `dim`."""

    sources: frozenset[str]
    dim: int


@dataclass
class Record:
    """What one or more traces saw."""

    order: list[str] = field(default_factory=list)  # linears, in the order first called
    consumers: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    inputs: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    cut: dict[str, str] = field(default_factory=dict)  # linear -> why its output stays whole
    news: set[str] = field(default_factory=set)  # linears cut other than where blocks end
    # linear -> the linears its output reaches by any path, split or whole (a head reaches none)
    feeds: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    other_uses: set[str] = field(default_factory=set)  # embeddings whose weight is used elsewhere
    called: set[str] = field(default_factory=set)  # every module name whose weight was used

    def merge(self, other: Record) -> None:
        """Add what another trace saw."""
        self.order += [n for n in other.order if n not in self.order]
        for name, found in other.consumers.items():
            self.consumers[name] |= found
        for name, found in other.inputs.items():
            self.inputs[name] |= found
        for name, why in other.cut.items():
            self.cut.setdefault(name, why)
        self.news |= other.news
        for name, found in other.feeds.items():
            self.feeds[name] |= found
        self.other_uses |= other.other_uses
        self.called |= other.called


def _meta(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and x.device.type != "meta":
        return torch.empty_strided(x.size(), x.stride(), dtype=x.dtype, device="meta")
    return x


def _read(func, args, kwargs):
    """A value read out of tensors: the real one when they hold data (a buffer of the model),
    else zero or False (a meta tensor holds none: a mask checked for being causal reads as not,
    a padding check as no padding)."""
    tensors = [x for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
    if not any(x.device.type == "meta" for x in tensors):
        return func(*args, **kwargs)
    name, first = func.__name__, tensors[0]
    if name == "tolist":
        return torch.zeros(first.shape, dtype=first.dtype).tolist()
    if name in ("item", "__int__", "__index__", "__float__"):
        return False if first.dtype == torch.bool else 0 if not first.is_floating_point() else 0.0
    return False


def op_name(func: Any) -> str:
    """A torch call's name without dunders, in-place marks and reflected forms (`__radd__`,
    `add_` and `torch.add` are all "add")."""
    name = getattr(func, "__name__", "")
    if name == "__get__":  # a property: x.mT, x.T
        name = getattr(getattr(func, "__self__", None), "__name__", name)
    name = name.strip("_")
    return RENAMED.get(name, name)


class Recorder(TorchFunctionMode):
    """The function mode of one trace: runs each call on meta tensors and follows the flows."""

    def __init__(self, weights: dict[int, tuple[str, str]], tp: int) -> None:
        super().__init__()
        self.weights, self.tp = weights, tp
        self.record = Record()
        self.flows: dict[int, tuple[torch.Tensor, Flow]] = {}  # id -> (tensor kept alive, flow)
        self.reach: dict[int, tuple[torch.Tensor, frozenset]] = {}  # id -> (tensor, linears)

    def flow(self, x: Any) -> Flow | None:
        found = self.flows.get(id(x)) if isinstance(x, torch.Tensor) else None
        return found[1] if found is not None and found[0] is x else None

    def reached(self, x: Any) -> frozenset:
        found = self.reach.get(id(x)) if isinstance(x, torch.Tensor) else None
        return found[1] if found is not None and found[0] is x else frozenset()

    def set_flow(self, x: torch.Tensor, flow: Flow) -> None:
        self.flows[id(x)] = (x, flow)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, spec = tree_flatten((args, kwargs))
        if getattr(func, "__name__", "") in READS:
            return _read(func, args, kwargs)
        margs, mkwargs = tree_unflatten([_meta(x) for x in flat], spec)
        out = func(*margs, **mkwargs)
        name = op_name(func)
        used = [u for x in flat if isinstance(x, torch.Tensor) and (u := self.weights.get(id(x)))]
        self.record.called |= {module for module, _ in used}
        # a tied weight used by an embedding call: the embedding's use, not the linear's
        linears = [m for m, kind in used if kind in (LINEAR, PLANNED) and name != "embedding"]
        self._follow(flat, out, linears)
        if name == "linear":
            self._linear(args, kwargs, out)
            return out
        if name == "embedding":
            self._cut_all(flat, "it indexes an embedding")
            return out
        for module, kind in used:
            if kind == EMBEDDING:
                self.record.other_uses.add(module)
        flowing = [f for x in flat if (f := self.flow(x)) is not None]
        if not flowing or not any(isinstance(o, torch.Tensor) for o in tree_leaves(out)):
            return out  # sizes, dtypes: nothing of the features is used
        sources = frozenset().union(*(f.sources for f in flowing))
        rule = RULES.get(name)
        try:
            if rule is None:
                raise Cut(f"{name} needs all of its features", natural="norm" in name)
            found = rule(self, name, args, kwargs, out)
        except Cut as cut:
            self._cut(sources, str(cut), cut.natural)
            return out
        for tensor, dim in found:
            self.set_flow(tensor, Flow(sources, dim))
        return out

    def _follow(self, flat, out, linears: list[str]) -> None:
        """Which linears each output is made from, whole or split (the linears of this call,
        else those of its inputs)."""
        came = frozenset().union(*(self.reached(x) for x in flat))
        for name in came:
            self.record.feeds[name].update(linears)
        made = frozenset(linears) or came
        if made:
            for o in tree_leaves(out):
                if isinstance(o, torch.Tensor):
                    self.reach[id(o)] = (o, made)

    def _cut(self, sources, why: str, natural: bool = False) -> None:
        for name in sources:
            self.record.cut.setdefault(name, why)
            if not natural:
                self.record.news.add(name)

    def _cut_all(self, flat, why: str, natural: bool = False) -> None:
        for x in flat:
            if (f := self.flow(x)) is not None:
                self._cut(f.sources, why, natural)

    def _linear(self, args, kwargs, out) -> None:
        x, weight = args[0], args[1] if len(args) > 1 else kwargs["weight"]
        module, kind = self.weights.get(id(weight), (None, None))
        flow = self.flow(x)
        if flow is not None:
            if kind != LINEAR:
                why = "it reaches a linear layer split otherwise or not at all"
                self._cut(flow.sources, why, natural=True)
            elif flow.dim != x.dim() - 1:
                self._cut(flow.sources, f"it reaches {module} on a dimension other than its last")
            else:
                for source in flow.sources:
                    self.record.consumers[source].add(module)
                self.record.inputs[module] |= flow.sources
        self._cut_all(tree_leaves((args[1:], kwargs)), "it is used as a weight")
        if kind == LINEAR:
            if module not in self.record.order:
                self.record.order.append(module)
            self.set_flow(out, Flow(frozenset({module}), out.dim() - 1))


def trace(module: torch.nn.Module, inputs: list, weights: dict[int, tuple[str, str]], tp: int):
    """The Record of one call of `module` on `inputs` (a forward on meta tensors: the model's
    weights, buffers and attributes are left as they were, its RNG untouched). `weights`: id of a
    weight -> (module name, LINEAR / EMBEDDING / PLANNED). Raises what the forward raises."""
    saved = _snapshot(module)
    recorder = Recorder(weights, tp)
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad(), recorder:
            out = module(*inputs)
    finally:
        _restore(saved)
    returned = f"it is returned by {type(module).__name__}"
    recorder._cut_all(tree_leaves(out), returned, natural=True)
    return recorder.record


def _snapshot(module: torch.nn.Module) -> list:
    """Every submodule's attributes as they are (a forward may set some, e.g. a cached mask)."""
    saved = []
    for m in module.modules():
        attrs = dict(m.__dict__)
        for key in ("_parameters", "_buffers", "_modules"):
            attrs[key] = dict(attrs[key])
        saved.append((m, attrs))
    return saved


def _restore(saved: list) -> None:
    for m, attrs in saved:
        for key in ("_parameters", "_buffers", "_modules"):
            live = m.__dict__[key]
            live.clear()
            live.update(attrs[key])
            attrs[key] = live
        m.__dict__.clear()
        m.__dict__.update(attrs)


# ---- the rules: each returns [(output tensor, its split dimension)] or raises Cut


def _unary(rec: Recorder, name, args, kwargs, out):
    flow = rec.flow(args[0])
    if flow is None or not isinstance(out, torch.Tensor) or out.shape != args[0].shape:
        raise Cut(f"{name} is applied to it in an unexpected way")
    return [(out, flow.dim)]


def _broadcast(rec: Recorder, name, args, kwargs, out):
    tensors = [x for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
    aligned = {f.dim - x.dim() for x in tensors if (f := rec.flow(x)) is not None}
    if len(aligned) != 1 or not isinstance(out, torch.Tensor):
        raise Cut(f"{name} combines it with a tensor split along another dimension")
    at = aligned.pop()
    for x in tensors:
        if rec.flow(x) is None and x.dim() >= -at and x.shape[at] != 1:
            raise Cut(f"{name} combines it with a whole tensor of its size", natural=True)
    return [(out, out.dim() + at)]


def _softmax(rec: Recorder, name, args, kwargs, out):
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    flow = rec.flow(args[0])
    if dim is None or dim % args[0].dim() == flow.dim:
        raise Cut(f"{name} normalises over its split features")
    return _unary(rec, name, args[:1], {}, out)


def _sizes(args, kwargs, start: int = 1):
    """The sizes a view or reshape was given, as written (with their -1)."""
    rest = args[start:] or [kwargs.get("size", kwargs.get("shape"))]
    if len(rest) == 1 and isinstance(rest[0], (tuple, list, torch.Size)):
        return list(rest[0])
    return list(rest)


def moved_dim(shape_in, dim: int, shape_out, tp: int) -> int:
    """Where split dimension `dim` of `shape_in` is after a reshape to `shape_out`: the outer
    of the dimensions it is cut into (heads: their number must divide by tp), or the dimension
    it is merged into as the outer part. Raises Cut when the split would not stay whole
    groups of contiguous features."""
    before, size = math.prod(shape_in[:dim]), shape_in[dim]
    j = _first_after(shape_out, before)
    got = shape_out[j]
    if got == size:
        return j
    if got < size:  # cut into groups (heads): the outer dimension holds them
        inner = 1
        for k in range(j, len(shape_out)):
            inner *= shape_out[k]
            if inner >= size:
                break
        if inner != size or size % got:
            raise Cut("a reshape cuts its features across dimensions")
        if got % tp:
            raise Cut(f"a reshape groups its features in {got}, which do not divide by tp={tp}")
        return j
    merged = size
    for k in range(dim + 1, len(shape_in) + 1):
        if merged >= got:
            break
        merged *= shape_in[k]
    if merged != got:
        raise Cut("a reshape merges its features across dimensions")
    return j


def _first_after(shape, before: int) -> int:
    """The first dimension of `shape` (not of size 1) whose outer dimensions hold `before`
    elements: where a dimension with `before` elements outside it went."""
    acc = 1
    for j, size in enumerate(shape):
        if acc == before and size != 1:
            return j
        acc *= size
        if acc > before:
            raise Cut("a reshape merges its split features into an outer dimension")
    raise Cut("a reshape drops its split features")


def _reshape(rec: Recorder, name, args, kwargs, out):
    x, flow = args[0], rec.flow(args[0])
    dim = moved_dim(tuple(x.shape), flow.dim, tuple(out.shape), rec.tp)
    if name in ("view", "reshape", "unflatten"):
        written = _sizes(args, kwargs, 1 if name != "unflatten" else 2)
        if name == "unflatten":
            start = args[1] % x.dim()
            written = [*([None] * start), *written]
        # the size of the split dimension must be left to the tensor: this rank holds a part
        if dim >= len(written) or written[dim] != -1:
            raise Cut(f"{name} gives its split dimension a fixed size (write -1 there)")
    if name in ("view_as", "reshape_as") and rec.flow(args[1]) is None:
        raise Cut(f"{name} takes a whole tensor's shape")
    return [(out, dim)]


def _expand(rec: Recorder, name, args, kwargs, out):
    x, flow = args[0], rec.flow(args[0])
    lead = out.dim() - x.dim()
    if name == "expand":
        written = _sizes(args, kwargs)
        if written[lead + flow.dim] != -1:
            raise Cut("expand gives its split dimension a fixed size (write -1 there)")
    elif out.shape[lead + flow.dim] != x.shape[flow.dim]:
        raise Cut(f"{name} changes its split dimension")
    return [(out, lead + flow.dim)]


def _transpose(rec: Recorder, name, args, kwargs, out):
    x, flow = args[0], rec.flow(args[0])
    n = x.dim()
    order = list(range(n))
    if name in ("t", "mt"):
        a, b = (n - 2, n - 1) if n >= 2 else (0, 0)
        order[a], order[b] = order[b], order[a]
    elif name == "transpose":
        a, b = args[1] % n, args[2] % n
        order[a], order[b] = order[b], order[a]
    elif name == "permute":
        dims = _sizes(args, kwargs)
        order = [d % n for d in dims]
    elif name == "movedim":
        src, dst = args[1], args[2]
        src = [s % n for s in (src if isinstance(src, (tuple, list)) else [src])]
        dst = [d % n for d in (dst if isinstance(dst, (tuple, list)) else [dst])]
        rest = [d for d in range(n) if d not in src]
        order = [None] * n
        for s, d in zip(src, dst, strict=True):
            order[d] = s
        free = iter(rest)
        order = [o if o is not None else next(free) for o in order]
    return [(out, order.index(flow.dim))]


def _squeeze(rec: Recorder, name, args, kwargs, out):
    x, flow = args[0], rec.flow(args[0])
    return [(out, moved_dim(tuple(x.shape), flow.dim, tuple(out.shape), rec.tp))]


def _getitem(rec: Recorder, name, args, kwargs, out):
    x, flow = args[0], rec.flow(args[0])
    index = args[1] if isinstance(args[1], tuple) else (args[1],)
    if any(isinstance(i, (torch.Tensor, list)) for i in index):
        raise Cut("advanced indexing selects from it")
    used = sum(1 for i in index if i is not None and i is not Ellipsis)
    expanded: list = []
    for i in index:
        expanded += [slice(None)] * (x.dim() - used) if i is Ellipsis else [i]
    expanded += [slice(None)] * (x.dim() - sum(1 for i in expanded if i is not None))
    dim_in, dim_out = 0, 0
    for i in expanded:
        if i is None:
            dim_out += 1
            continue
        if dim_in == flow.dim:
            if i != slice(None):
                raise Cut("indexing selects part of its split features")
            return [(out, dim_out)]
        dim_in += 1
        dim_out += 0 if isinstance(i, int) else 1
    raise Cut("indexing drops its split features")


def _pieces(rec: Recorder, name, args, kwargs, out):
    x, flow = args[0], rec.flow(args[0])
    if name in ("select", "narrow"):
        dim = args[1]
    elif name in ("split", "chunk", "tensor_split"):
        dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
    else:  # unbind
        dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    dim %= x.dim()
    if dim == flow.dim:
        raise Cut(f"{name} splits it along its split features (a fused projection)")
    drops = name in ("unbind", "select")
    at = flow.dim - (1 if drops and dim < flow.dim else 0)
    outs = out if isinstance(out, (tuple, list)) else [out]
    return [(o, at) for o in outs]


def _cat(rec: Recorder, name, args, kwargs, out):
    tensors = args[0]
    dim = (args[1] if len(args) > 1 else kwargs.get("dim", 0)) % (
        tensors[0].dim() + (1 if name == "stack" else 0)
    )
    flows = [rec.flow(t) for t in tensors]
    if any(f is None for f in flows) or len({f.dim for f in flows}) != 1:
        raise Cut(f"{name} joins it with a tensor split otherwise")
    at = flows[0].dim
    if name == "cat" and dim == at:
        raise Cut("cat joins along its split features")
    return [(out, at + (1 if name == "stack" and dim <= at else 0))]


def _batch_dim(rec: Recorder, name: str, tensors, others=()) -> int:
    """The one batch (head) dimension, counted from the right, along which all of `tensors`
    are split; `others` must broadcast along it."""
    aligned = set()
    for x in tensors:
        flow = rec.flow(x)
        if flow is None:
            raise Cut(f"{name} combines it with a whole tensor")
        aligned.add(flow.dim - x.dim())
    if len(aligned) != 1 or (at := aligned.pop()) >= -2:
        raise Cut(f"{name} contracts or mixes its split features")
    for x in others:
        whole = isinstance(x, torch.Tensor) and rec.flow(x) is None
        if whole and x.dim() >= -at and x.shape[at] != 1:
            raise Cut(f"{name} combines it with a whole tensor of its size")
    return at


def _attention(rec: Recorder, name, args, kwargs, out):
    q, k, v = (args + (None, None, None))[:3]
    k = k if k is not None else kwargs.get("key")
    v = v if v is not None else kwargs.get("value")
    mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
    at = _batch_dim(rec, name, [q, k, v], [mask])
    return [(out, out.dim() + at)]


def _matmul(rec: Recorder, name, args, kwargs, out):
    if name == "baddbmm":
        at = _batch_dim(rec, name, [args[1], args[2]], [args[0]])
    else:
        at = _batch_dim(rec, name, [args[0], args[1]])
    return [(out, out.dim() + at)]


RULES = {name: _unary for name in UNARY}
RULES |= {name: _broadcast for name in BROADCAST}
RULES |= {"softmax": _softmax, "log_softmax": _softmax}
RULES |= {n: _reshape for n in ("view", "reshape", "unflatten", "flatten", "view_as")}
RULES |= {"reshape_as": _reshape, "expand": _expand, "expand_as": _expand}
RULES |= {n: _transpose for n in ("transpose", "permute", "t", "mt", "movedim")}
RULES |= {"squeeze": _squeeze, "unsqueeze": _squeeze, "getitem": _getitem}
RULES |= {n: _pieces for n in ("split", "chunk", "tensor_split", "unbind", "select", "narrow")}
RULES |= {"cat": _cat, "stack": _cat, "scaled_dot_product_attention": _attention}
RULES |= {n: _matmul for n in ("matmul", "bmm", "baddbmm")}
