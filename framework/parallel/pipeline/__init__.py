"""Cutting a model into pipeline stages (torch only; no process group needed).

A model that can be pipelined is a chain of layers, each a function of the previous one's output.
It says so in one of three ways:

- `pipeline_layers()` returning `[(names, run), ...]` in order: `names` are the submodules (names
  relative to the model) whose parameters `run` uses, `run` maps the previous output to the next.
  `framework.nn` models declare it (e.g. the gpt recipe: embeddings, each block, norm + head);
- or being an `nn.Sequential`: each child is a layer;
- or belonging to a model family whose adapter reads its chain (framework/parallel/model.py:
  a transformers model with a pipeline plan, held anywhere in the task: embedding, each decoder
  layer, final norm + head).

The task's pipelined model is its first child declaring layers or being an nn.Sequential, else
the first a model family finds. The last stage computes the loss: the task's own `loss` (on
`pipeline_batch`'s target), or for a task with none the loss its model family supplies (a
transformers causal LM's own causal-LM loss; `objective`).

A stage is a contiguous run of layers: balanced by parameter count (tied parameters counted
once) or by each layer's measured forward + backward time (`time_layers`), or started at the
layers the config names (`strategy.split_points`). Every rank builds the whole model from the
seed (so initial weights are the one-process ones) and then drops the modules of the stages it
does not run; parameter names do not change, so checkpoints of any split read back by name.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

from torch import nn

from framework.parallel.model import Objective


@dataclass(frozen=True)
class Layer:
    name: str  # full name of the first submodule it owns (as the task names it)
    modules: tuple[str, ...]  # full names of the submodules it owns
    run: Callable[[Any], Any]


def find_model(task: nn.Module) -> tuple[str, nn.Module] | None:
    """The task's pipelined model: its first child declaring layers, or an nn.Sequential, else
    the first a model family finds (a transformers model with a pipeline plan)."""
    from framework.parallel.model import adapter_for

    found = adapter_for(task).pipeline_model(task)
    return None if found is None else found[:2]


def layers(task: nn.Module) -> list[Layer]:
    """The chain of layers of the task's pipelined model (ValueError when it has none)."""
    if find_model(task) is None:
        raise ValueError(
            f"{type(task).__name__} has no child module that can be cut into pipeline stages: "
            "give the model a pipeline_layers() method (framework.nn models have one), make "
            "it an nn.Sequential, or hold a transformers model with a pp_plan"
        )
    from framework.parallel.model import adapter_for

    prefix, model, family = adapter_for(task).pipeline_model(task)
    declared = family.pipeline_layers(model)
    chain = []
    for names, run in declared:
        full = tuple(f"{prefix}.{n}" if prefix else n for n in names)
        chain.append(Layer(full[0], full, run))
    return chain


def objective(task: nn.Module) -> Objective | None:
    """The task's own `loss` (and `pipeline_batch`, else (x, y) batches); for a task with no
    loss of its own, the loss its model family supplies (a transformers causal LM's on its
    token batches); None when there is neither."""
    from framework.parallel.model import adapter_for

    own = getattr(task, "pipeline_batch", None) or _pair
    if _defines_loss(task):
        return Objective(own, task.loss)
    return adapter_for(task).pipeline_loss(
        task, own if _overrides(task, "pipeline_batch") else None
    )


def _pair(batch: Any) -> tuple[Any, Any]:
    x, y = batch
    return x, y


def _defines_loss(task: nn.Module) -> bool:
    return callable(getattr(task, "loss", None)) and _overrides(task, "loss")


def _overrides(task: nn.Module, method: str) -> bool:
    """Whether the task's class defines `method` itself, not only inherits TaskModule's."""
    from framework.task import TaskModule

    mine = getattr(type(task), method, None)
    return mine is not None and mine is not getattr(TaskModule, method, None)


def check_covered(task: nn.Module, chain: Sequence[Layer]) -> None:
    """Every parameter of the task belongs to a layer (else a stage could not update it)."""
    owned = {id(p) for layer in chain for m in layer.modules for p in _get(task, m).parameters()}
    loose = [n for n, p in task.named_parameters() if id(p) not in owned]
    if loose:
        raise ValueError(
            f"parameters of {type(task).__name__} belong to no pipeline layer: "
            f"{', '.join(loose[:6])}; put them in a module the model's pipeline_layers() names"
        )


def costs(task: nn.Module, chain: Sequence[Layer]) -> list[int]:
    """Parameter count of each layer, a tied parameter counted in the first layer using it."""
    seen: set[int] = set()
    out = []
    for layer in chain:
        total = 0
        for name in layer.modules:
            for p in _get(task, name).parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    total += p.numel()
        out.append(total)
    return out


def time_layers(
    chain: Sequence[Layer],
    x: Any,
    loss: Callable[[Any], Any],
    repeats: int = 3,
    place: Callable[[Layer], AbstractContextManager] | None = None,
) -> list[float]:
    """Seconds of forward + backward of each layer on input `x` (median of `repeats`); the last
    layer's time includes `loss(output)`. `place(layer)`: a context in which the layer is on
    `x`'s device (so only one layer at a time need be there). Leaves gradients in the
    parameters."""
    import time

    import torch

    place = place or (lambda layer: nullcontext())
    inputs = []
    with torch.no_grad():
        for layer in chain:
            inputs.append(x)
            with place(layer):
                x = layer.run(x)
    times = []
    for i, layer in enumerate(chain):
        runs = []
        with place(layer):
            for _ in range(repeats):
                h = inputs[i]
                if h.is_floating_point():
                    h = h.detach().requires_grad_()
                start = time.perf_counter()
                out = layer.run(h)
                (loss(out) if i == len(chain) - 1 else out.float().sum()).backward()
                if out.is_cuda:
                    torch.cuda.synchronize()
                runs.append(time.perf_counter() - start)
        times.append(sorted(runs)[repeats // 2])
    return times


def balance(weights: Sequence[float], n_stages: int) -> list[int]:
    """First layer of each of `n_stages` contiguous stages, minimising the heaviest stage.

    Exact (dynamic programming over cut positions); ties go to the earliest cuts. Every stage
    gets at least one layer.
    """
    n = len(weights)
    if not 1 <= n_stages <= n:
        raise ValueError(f"{n_stages} stages cannot be cut from {n} layers")
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[k][i]: the smallest heaviest stage cutting the first i layers into k stages
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0
    for k in range(1, n_stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    starts, i = [], n
    for k in range(n_stages, 0, -1):
        i = cut[k][i]
        starts.append(i)
    return starts[::-1]


def starts_at(chain: Sequence[Layer], points: Sequence[str]) -> list[int]:
    """First layer of each stage from split points: the layers where stages 2, 3, ... begin."""
    index = {}
    for i, layer in enumerate(chain):
        for name in layer.modules:
            index[name] = i
    starts = [0]
    for point in points:
        if point not in index:
            raise KeyError(point)
        starts.append(index[point])
    if any(b <= a for a, b in zip(starts, starts[1:], strict=False)):
        raise ValueError(f"split points {list(points)} are not in layer order, or repeat one")
    return starts


def stage_layers(chain: Sequence[Layer], starts: Sequence[int], stage: int) -> list[Layer]:
    end = starts[stage + 1] if stage + 1 < len(starts) else len(chain)
    return list(chain[starts[stage] : end])


class Stage(nn.Module):
    """The layers of one stage as one module (what torch's PipelineStage runs).

    It holds the task's own submodules, so its parameters are the task's (names in checkpoints
    stay the task's); `forward` runs the layers in order.
    """

    def __init__(self, task: nn.Module, chain: Sequence[Layer]) -> None:
        super().__init__()
        unique = {id(m): m for layer in chain for m in (_get(task, n) for n in layer.modules)}
        self.parts = nn.ModuleList(unique.values())
        self._runs = [layer.run for layer in chain]

    def forward(self, x):
        for run in self._runs:
            x = run(x)
        return x


def keep_only(task: nn.Module, chain: Sequence[Layer], kept: Sequence[Layer]) -> None:
    """Drop from the task the layers' submodules no kept layer owns (their parameters go)."""
    keep = {name for layer in kept for name in layer.modules}
    for layer in chain:
        for name in layer.modules:
            if name not in keep:
                parent, _, child = name.rpartition(".")
                _get(task, parent)._modules[child] = None


def shared_parameters(task: nn.Module, chain: Sequence[Layer], starts: Sequence[int]) -> list[Any]:
    """Parameters used by more than one stage (tied weights), in a fixed order, with the stages
    using each: [(name, parameter, stages)]."""
    users: dict[int, list] = {}
    for stage in range(len(starts)):
        for layer in stage_layers(chain, starts, stage):
            for module in layer.modules:
                for p in _get(task, module).parameters():
                    entry = users.setdefault(id(p), [p, []])
                    if stage not in entry[1]:
                        entry[1].append(stage)
    names = {id(p): n for n, p in task.named_parameters()}
    return [(names[k], p, s) for k, (p, s) in users.items() if len(s) > 1]


def tied_across_layers(task: nn.Module, chain: Sequence[Layer]) -> bool:
    """Whether some parameter is used by two layers of the chain (a tied embedding and head)."""
    users: dict[int, int] = {}
    for i, layer in enumerate(chain):
        for name in layer.modules:
            for p in _get(task, name).parameters():
                if users.setdefault(id(p), i) != i:
                    return True
    return False


def _get(root: nn.Module, name: str) -> nn.Module:
    return root.get_submodule(name) if name else root
