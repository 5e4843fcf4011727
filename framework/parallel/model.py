"""The one seam between the parallel core and the models it splits: `ModelAdapter`.

The parallel core (tensor, pipeline, context and expert parallel, FSDP units, activation
checkpointing, pretrained loads) asks a task's model what it is made of through one object,
`adapter_for(task)`, and never looks at a model family itself. Each family answers for its own
modules:

- `DeclaredAdapter` (here): what a model declares with the framework's own protocol, as
  framework.nn blocks do: `tp_plan()` methods, `pipeline_layers()` or an `nn.Sequential`, a
  `context` attribute on attention modules, MoE layers (framework.nn.moe), `nn.ModuleList`
  layers. Any user module can declare the same;
- the families listed in `FAMILIES` (transformers models, framework/integrations/hf/adapter.py),
  imported by name only when a task is looked at, and any a user adds with `register`.

A family adapter subclasses `FamilyAdapter` (every question answered "nothing of mine" by
default) and answers only for the modules it recognises; `adapter_for` combines the families
that claim a part of the task into one `TaskAdapter`, which generic code calls.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from torch import nn

# model families besides the declared protocol: "module:attribute" of an adapter instance,
# imported only when a task is looked at (generic code never imports an adapter's module)
FAMILIES: list[str] = [
    "framework.integrations.hf.adapter:ADAPTER",
    "framework.integrations.torch_nn:ADAPTER",
]
_registered: list[Any] = []

Chain = list[tuple[tuple[str, ...], Callable[[Any], Any]]]  # [(module names, run)] in order


@dataclass(frozen=True)
class ExpertBlock:
    """A mixture-of-experts block a family swaps for a framework MoE layer under ep > 1."""

    path: str  # in the task
    num_experts: int
    kind: str = "MoE block"  # what it is, for messages


@dataclass(frozen=True)
class RoutedWeights:
    """Expert weights of which a token runs through `top_k` of `num_experts` (fw plan's FLOPs)."""

    weights: list[Any]
    top_k: int | None
    num_experts: int | None


@dataclass(frozen=True)
class Objective:
    """What a pipeline's last stage minimises: `split(batch)` is (first stage's input, loss
    target), `loss(output, target)` a microbatch's loss; `begin(target, parts)` sees each whole
    batch's target before its `parts` microbatches."""

    split: Callable[[Any], tuple[Any, Any]]
    loss: Callable[[Any, Any], Any]
    begin: Callable[[Any, int], None] = lambda target, parts: None


class ModelAdapter(Protocol):
    """What the parallel core asks of one model family. Every method answers for the family's
    own modules in `task` only (a task may hold several families); `FamilyAdapter` gives the
    "nothing of mine" answer to each."""

    name: str
    standard_layers: bool  # plans of standard layers, the rest inferred (FamilyAdapter's)

    def claims(self, task: nn.Module) -> bool:
        """Whether `task` holds a module of this family (cheap: no import of the family's
        library unless the task's code imported it already)."""

    def tensor_plan(
        self, task: nn.Module, *, skip=(), sequence_parallel=False, loss_parallel=False, experts=()
    ) -> dict[str, Any]:
        """{module name in the task: framework style name (framework.parallel.tensor.STYLES) or
        a torch ParallelStyle} for the family's modules. `skip`: patterns the config's
        `strategy.tp_plan` gives (those modules are left alone); `experts`: paths of the MoE
        blocks expert parallel splits (kept whole on every tensor-parallel rank). Raises
        ConfigError for a module whose split the framework cannot apply."""

    def check_tensor(self, task: nn.Module, tp: int) -> None:
        """ConfigError when the family's modules cannot be split over `tp` ranks (e.g. heads
        that do not divide)."""

    def blocks(self, task: nn.Module) -> list[nn.Module] | None:
        """The family's layers (FSDP units, activation checkpointing), or None: no opinion."""

    def before_checkpointing(self, task: nn.Module) -> None:
        """Make the family's modules safe to recompute in backward (e.g. no key/value cache)."""

    def pipeline_model(self, task: nn.Module) -> tuple[str, nn.Module] | None:
        """(path in the task, model) of the family's model that can be cut into stages."""

    def pipeline_layers(self, model: nn.Module) -> Chain:
        """The chain of layers of a model `pipeline_model` returned (ValueError: none)."""

    def pipeline_loss(self, task: nn.Module, split: Callable | None) -> Objective | None:
        """The loss a pipeline's last stage computes for a task with no `loss` of its own
        (`split`: the task's own `pipeline_batch`, or None), or None: the family has none."""

    def check_pipeline(self, task: nn.Module, pp: int) -> None:
        """ConfigError for what the stages of the family's model cannot compute."""

    def describe_layers(self, path: str, model: nn.Module) -> str | None:
        """What a layer count of the family's pipelined model is made of (messages)."""

    def attach_context(self, task: nn.Module, plan: Any) -> None:
        """Give the family's attention, positions and labels the context plan (cp > 1)."""

    def check_context(self, task: nn.Module, cp: int, mode: str, tp: int) -> bool:
        """ConfigError unless the family's models can be split over the sequence; returns
        whether the task holds any (False: the declared attention modules are checked)."""

    def expert_blocks(self, task: nn.Module, ep: int) -> list[ExpertBlock]:
        """The family's MoE blocks `swap_experts` would swap (ConfigError for one it cannot)."""

    def swap_experts(self, task: nn.Module, ep: int) -> None:
        """Swap the family's MoE blocks for framework MoE layers (ep > 1), names kept."""

    def routed_weights(self, task: nn.Module) -> list[RoutedWeights]:
        """The family's expert weights and how many of them a token runs through."""

    def load_pretrained(self, task: nn.Module, device: Any, run_dir: Any, rank: int) -> list:
        """Read the weights of the family's models built on meta, this rank's slices only."""

    def pretrained_sources(self, task: nn.Module) -> list:
        """A checkpoint Source (framework/checkpoint/portable.py) over the pretrained weights of
        each of the family's models still on meta, named as the task names them (for a strategy
        that fills its own partitions: ZeRO-3)."""

    def export_records(self, task: nn.Module) -> list[dict[str, Any]]:
        """What the family's export format needs to know of each of its models, as data (JSON:
        recorded in every checkpoint's meta.json, so `fw export` builds nothing the run directory
        names)."""


class FamilyAdapter:
    """The base of a family adapter: every question answered "nothing of mine"."""

    name = "family"
    # True for a family of standard layers whose plans are known, not written for one model
    # (torch's own transformer layers): a model made of them and plain modules has the rest of
    # its plan inferred (framework/parallel/infer.py). False: the family's plans are its
    # models' own, complete as declared.
    standard_layers = False

    def claims(self, task: nn.Module) -> bool:
        return False

    def tensor_plan(
        self, task: nn.Module, *, skip=(), sequence_parallel=False, loss_parallel=False, experts=()
    ) -> dict[str, Any]:
        return {}

    def check_tensor(self, task: nn.Module, tp: int) -> None:
        return None

    def blocks(self, task: nn.Module) -> list[nn.Module] | None:
        return None

    def before_checkpointing(self, task: nn.Module) -> None:
        return None

    def pipeline_model(self, task: nn.Module) -> tuple[str, nn.Module] | None:
        return None

    def pipeline_layers(self, model: nn.Module) -> Chain:
        raise ValueError(f"{type(model).__name__} declares no pipeline layers")

    def pipeline_loss(self, task: nn.Module, split: Callable | None) -> Objective | None:
        return None

    def check_pipeline(self, task: nn.Module, pp: int) -> None:
        return None

    def describe_layers(self, path: str, model: nn.Module) -> str | None:
        return None

    def attach_context(self, task: nn.Module, plan: Any) -> None:
        return None

    def check_context(self, task: nn.Module, cp: int, mode: str, tp: int) -> bool:
        return False

    def expert_blocks(self, task: nn.Module, ep: int) -> list[ExpertBlock]:
        return []

    def swap_experts(self, task: nn.Module, ep: int) -> None:
        return None

    def routed_weights(self, task: nn.Module) -> list[RoutedWeights]:
        return []

    def load_pretrained(self, task: nn.Module, device: Any, run_dir: Any, rank: int) -> list:
        return []

    def pretrained_sources(self, task: nn.Module) -> list:
        return []

    def export_records(self, task: nn.Module) -> list[dict[str, Any]]:
        return []


class DeclaredAdapter(FamilyAdapter):
    """What a model declares with the framework's own protocol (framework.nn blocks, or any
    module written the same way): plans by `tp_plan()`, stages by `pipeline_layers()` or as an
    `nn.Sequential`, layers as `nn.ModuleList` members."""

    name = "declared"

    def claims(self, task: nn.Module) -> bool:
        return True

    def tensor_plan(
        self, task: nn.Module, *, skip=(), sequence_parallel=False, loss_parallel=False, experts=()
    ) -> dict[str, Any]:
        import inspect

        options = {"sequence_parallel": sequence_parallel, "loss_parallel": loss_parallel}
        plan: dict[str, Any] = {}
        for name, module in task.named_modules():
            if not callable(getattr(type(module), "tp_plan", None)):
                continue
            accepted = inspect.signature(module.tp_plan).parameters
            own = module.tp_plan(**{k: v for k, v in options.items() if k in accepted and v})
            for sub, entry in own.items():
                plan[".".join(p for p in (name, sub) if p)] = entry
        return plan

    def blocks(self, task: nn.Module) -> list[nn.Module] | None:
        return [
            m
            for lst in task.modules()
            if isinstance(lst, nn.ModuleList)
            for m in lst
            if m is not None  # a layer a pipeline stage dropped
        ]

    def pipeline_model(self, task: nn.Module) -> tuple[str, nn.Module] | None:
        for name, child in task.named_children():
            if hasattr(child, "pipeline_layers") or isinstance(child, nn.Sequential):
                return name, child
        return None

    def pipeline_layers(self, model: nn.Module) -> Chain:
        if hasattr(model, "pipeline_layers"):
            return model.pipeline_layers()
        if isinstance(model, nn.Sequential):
            return [((name,), child) for name, child in model.named_children()]
        return super().pipeline_layers(model)


def register(adapter: Any) -> None:
    """Add a model family (an object with `ModelAdapter`'s methods, e.g. a `FamilyAdapter`
    subclass) for every task looked at from now on in this process; call it where the family's
    models are defined (the task's module), so that every worker registers it too."""
    if adapter not in _registered:
        _registered.append(adapter)


def families() -> list[Any]:
    """The family adapters: the built-in ones (imported now), then the registered ones."""
    found = []
    for entry in FAMILIES:
        module, _, attr = entry.partition(":")
        found.append(getattr(importlib.import_module(module), attr))
    return [*found, *_registered]


class TaskAdapter:
    """The adapters that claim a part of one task, asked together: plans are merged, the first
    family with an answer gives it (the declared protocol first)."""

    def __init__(self, adapters: list[Any]) -> None:
        self.adapters = adapters

    def tensor_plan(
        self, task, *, skip=(), sequence_parallel=False, loss_parallel=False, experts=()
    ):
        plan: dict[str, Any] = {}
        for adapter in self.adapters:
            found = adapter.tensor_plan(
                task,
                skip=skip,
                sequence_parallel=sequence_parallel,
                loss_parallel=loss_parallel,
                experts=experts,
            )
            plan.update({k: v for k, v in found.items() if k not in plan})
        return plan

    def declares_plan(self, task, **options) -> bool:
        """Whether a family that declares its models' own plans (not a standard-layer one)
        has a plan for the task (`options`: tensor_plan's): then nothing of it is inferred."""
        return any(
            adapter.tensor_plan(task, **options)
            for adapter in self.adapters
            if not adapter.standard_layers
        )

    def check_tensor(self, task, tp: int) -> None:
        for adapter in self.adapters:
            adapter.check_tensor(task, tp)

    def blocks(self, task) -> list[nn.Module]:
        """The layers of the first family with an opinion, else the declared protocol's
        (every ModuleList member)."""
        for adapter in [*self.adapters[1:], self.adapters[0]]:
            found = adapter.blocks(task)
            if found is not None:
                return found
        return []

    def before_checkpointing(self, task) -> None:
        for adapter in self.adapters:
            adapter.before_checkpointing(task)

    def pipeline_model(self, task):
        """(path, model, adapter) of the task's pipelined model, or None."""
        for adapter in self.adapters:
            found = adapter.pipeline_model(task)
            if found is not None:
                return (*found, adapter)
        return None

    def pipeline_loss(self, task, split):
        for adapter in self.adapters:
            found = adapter.pipeline_loss(task, split)
            if found is not None:
                return found
        return None

    def check_pipeline(self, task, pp: int) -> None:
        for adapter in self.adapters:
            adapter.check_pipeline(task, pp)

    def describe_layers(self, path: str, model) -> str | None:
        return next(
            (d for a in self.adapters if (d := a.describe_layers(path, model)) is not None), None
        )

    def attach_context(self, task, plan) -> None:
        for adapter in self.adapters:
            adapter.attach_context(task, plan)

    def check_context(self, task, cp: int, mode: str, tp: int) -> bool:
        return any([a.check_context(task, cp, mode, tp) for a in self.adapters])

    def expert_blocks(self, task, ep: int) -> list[ExpertBlock]:
        return [b for a in self.adapters for b in a.expert_blocks(task, ep)]

    def swap_experts(self, task, ep: int) -> None:
        for adapter in self.adapters:
            adapter.swap_experts(task, ep)

    def routed_weights(self, task) -> list[RoutedWeights]:
        return [w for a in self.adapters for w in a.routed_weights(task)]

    def load_pretrained(self, task, device, run_dir, rank: int) -> list:
        return [r for a in self.adapters for r in a.load_pretrained(task, device, run_dir, rank)]

    def pretrained_sources(self, task) -> list:
        return [s for a in self.adapters for s in a.pretrained_sources(task)]

    def export_records(self, task) -> dict[str, list[dict[str, Any]]]:
        """{family name: its records} of the families that have any."""
        found = {a.name: a.export_records(task) for a in self.adapters}
        return {name: records for name, records in found.items() if records}


DECLARED = DeclaredAdapter()


def adapter_for(task: nn.Module) -> TaskAdapter:
    """The adapters of the model families `task` holds, the declared protocol first."""
    return TaskAdapter([DECLARED, *(a for a in families() if a.claims(task))])
