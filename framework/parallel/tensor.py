"""Applying tensor-parallel plans to a model (imports torch.distributed.tensor lazily)."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from framework.parallel.keys import matches

STYLES = (
    "colwise",
    "rowwise",
    "colwise_gather",
    "rowwise_embedding",
    "sequence",
    "split_sequence",
    "gather_sequence",
    "rowwise_scatter_sequence",
    "colwise_gather_from_sequence",
    "colwise_sharded_logits",
    "colwise_sharded_logits_from_sequence",
    "split_sequence_input",
    "gather_sequence_input",
    "replicate_input",
    "rowwise_from_replicated",
    "replicated_grad_sum",
    "gather_sequence_whole",
    "multihead_attention",
)


def style(name: str) -> Any:
    """A torch ParallelStyle from its name in a config or a `tp_plan()`.

    colwise: split the output features (the output stays split); rowwise: split the input features
    and all-reduce the output; colwise_gather: colwise, then all-gather the output (an LM head);
    rowwise_embedding: an embedding split over its rows (the vocabulary), output all-reduced.
    Sequence parallel (dimension 1 is the sequence): sequence: run the module (a norm) on this
    rank's positions; split_sequence: keep this rank's positions of a replicated output (no
    communication); gather_sequence: all-gather the input's positions before the module;
    rowwise_scatter_sequence: rowwise with a reduce-scatter over positions instead of the
    all-reduce; colwise_gather_from_sequence: all-gather the positions, then colwise_gather.
    For a module given its hidden states as first argument or as the keyword `hidden_states`
    (transformers' decoder layers and attention): split_sequence_input: keep this rank's
    positions of them; gather_sequence_input: all-gather them (as gather_sequence);
    replicate_input: hand them on as a replicated DTensor, so that the column-split linears
    inside add their input gradients into one partial sum, all-reduced once at the module's input
    rather than once per linear. rowwise_from_replicated: rowwise for a whole input, which each
    rank slices itself. replicated_grad_sum: the weights stay whole and run on this rank's part
    of an activation split over tp (a per-head norm after a column split); their gradients are
    summed over the ranks. gather_sequence_whole: all-gather the positions of the module's
    first input into a plain whole tensor, run the module on it as every tp rank does, and keep
    this rank's positions of its output (whose gradient backward all-gathers, so each rank
    computes the whole module's gradients: a MoE block whose experts ep splits).
    multihead_attention: torch's nn.MultiheadAttention split by whole heads, its output
    all-reduced (framework/parallel/multihead.py).
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleInputOutput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
    )

    makers = {
        "colwise": lambda: ColwiseParallel(),
        "rowwise": lambda: RowwiseParallel(),
        "colwise_gather": lambda: ColwiseParallel(output_layouts=Replicate()),
        "colwise_sharded_logits": lambda: ColwiseParallel(
            output_layouts=Shard(-1), use_local_output=False
        ),
        "colwise_sharded_logits_from_sequence": lambda: ColwiseParallel(
            input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False
        ),
        "rowwise_embedding": lambda: RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Replicate()
        ),
        "sequence": lambda: SequenceParallel(use_local_output=True),
        "split_sequence": lambda: PrepareModuleOutput(
            output_layouts=Replicate(), desired_output_layouts=Shard(1), use_local_output=True
        ),
        # the module gets a DTensor: its gradient reaches the all-gather as a partial sum, which
        # makes the backward a reduce-scatter (a plain tensor would make it an all-reduce)
        "gather_sequence": lambda: PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
        ),
        "rowwise_scatter_sequence": lambda: RowwiseParallel(output_layouts=Shard(1)),
        "colwise_gather_from_sequence": lambda: ColwiseParallel(
            input_layouts=Shard(1), output_layouts=Replicate()
        ),
        "gather_sequence_whole": lambda: PrepareModuleInputOutput(
            input_layouts=(Shard(1),),
            desired_input_layouts=(Replicate(),),
            use_local_input=True,
            output_layouts=(Replicate(),),
            desired_output_layouts=(Shard(1),),
            use_local_output=True,
        ),
    }
    own = _own_styles()
    makers |= {
        "split_sequence_input": lambda: own["HiddenStates"](Replicate(), Shard(1), True),
        "gather_sequence_input": lambda: own["HiddenStates"](Shard(1), Replicate()),
        "replicate_input": lambda: own["HiddenStates"](Replicate(), Replicate()),
        "rowwise_from_replicated": lambda: RowwiseParallel(input_layouts=Replicate()),
        "replicated_grad_sum": lambda: own["ReplicatedGradSum"](),
        "multihead_attention": _heads,
    }
    if name not in makers:
        raise ValueError(f"unknown tensor-parallel style {name!r}; known: {', '.join(STYLES)}")
    return makers[name]()


def _heads():
    from framework.parallel.multihead import heads_parallel

    return heads_parallel()


@functools.cache
def _own_styles() -> dict[str, type]:
    """The framework's own ParallelStyles, made once when first asked for (importing this module
    does not import torch.distributed.tensor)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate
    from torch.distributed.tensor.parallel import ParallelStyle

    class HiddenStates(ParallelStyle):
        """Redistributes a module's hidden states, its first positional argument or its keyword
        `hidden_states`, from `given` to `wanted` (a DTensor, or its local part)."""

        def __init__(self, given, wanted, use_local_output: bool = False) -> None:
            self.given, self.wanted, self.use_local_output = given, wanted, use_local_output

        def _apply(self, module: nn.Module, mesh) -> nn.Module:
            def prepare(_, args, kwargs):
                if args:
                    return (self._redistribute(args[0], mesh), *args[1:]), kwargs
                hidden = self._redistribute(kwargs["hidden_states"], mesh)
                return args, {**kwargs, "hidden_states": hidden}

            module.register_forward_pre_hook(prepare, with_kwargs=True)
            return module

        def _redistribute(self, x: torch.Tensor, mesh):
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, mesh, [self.given], run_check=False)
            if Replicate() not in (self.given, self.wanted) and x.shape[1] % mesh.size():
                raise ValueError(
                    f"sequence parallel splits each sequence over the tp={mesh.size()} ranks, "
                    f"and its {x.shape[1]} positions do not split evenly: use a sequence length "
                    f"that is a multiple of {mesh.size()}"
                )
            x = x.redistribute(mesh, [self.wanted])
            return x.to_local() if self.use_local_output else x

    class ReplicatedGradSum(ParallelStyle):
        """The module's parameters become replicated DTensors; its forward runs on their local
        values (plain tensors: no DTensor dispatch) with their gradient marked a partial sum,
        summed over the ranks once accumulated (FSDP2, when it shards them too, sums it itself:
        it gives each gradient its parameter's placements first)."""

        def _apply(self, module: nn.Module, mesh) -> nn.Module:
            for name, param in list(module.named_parameters(recurse=False)):
                whole = DTensor.from_local(param.detach(), mesh, [Replicate()], run_check=False)
                param = nn.Parameter(whole, requires_grad=param.requires_grad)
                if param.requires_grad:
                    param.register_post_accumulate_grad_hook(_sum_partial_grad)
                module.register_parameter(name, param)
            held: dict[str, torch.Tensor] = {}

            def local(mod, args):
                for name, p in list(mod._parameters.items()):
                    if isinstance(p, DTensor):
                        held[name] = p
                        mod._parameters[name] = p.to_local(grad_placements=[Partial()])

            def restore(mod, args, output):
                mod._parameters.update(held)
                held.clear()

            module.register_forward_pre_hook(local)
            module.register_forward_hook(restore, always_call=True)
            return module

    return {"HiddenStates": HiddenStates, "ReplicatedGradSum": ReplicatedGradSum}


def _sum_partial_grad(param: torch.Tensor) -> None:
    from torch.distributed.tensor import Partial, Replicate

    grad = param.grad
    if grad is not None and any(isinstance(p, Partial) for p in grad.placements):
        param.grad = grad.redistribute(grad.device_mesh, [Replicate()] * len(grad.placements))


def collect_plan(
    model: nn.Module,
    sequence_parallel: bool = False,
    loss_parallel: bool = False,
    skip: tuple[str, ...] | list[str] = (),
    experts: tuple[str, ...] | list[str] = (),
) -> dict[str, Any]:
    """{absolute module name: ParallelStyle} from the plans the task's model families declare
    (framework.parallel.model: `tp_plan()` methods, a transformers model's own plan, ...);
    `skip`: patterns given elsewhere (strategy.tp_plan), whose modules the families leave
    alone; `experts`: the MoE blocks expert parallel splits instead.

    A `tp_plan()` maps names relative to its module ("" for the module itself; * wildcards
    allowed) to a ParallelStyle or a style name.
    """
    from framework.parallel.model import adapter_for

    declared = adapter_for(model).tensor_plan(
        model,
        skip=skip,
        sequence_parallel=sequence_parallel,
        loss_parallel=loss_parallel,
        experts=experts,
    )
    return {name: style(s) if isinstance(s, str) else s for name, s in declared.items()}


def apply_tensor_parallel(
    model: nn.Module,
    mesh,
    extra: dict[str, Any] | None = None,
    sequence_parallel: bool = False,
    loss_parallel: bool = False,
) -> int:
    """Shard `model` in place over the 1-D tensor-parallel `mesh`; returns how many modules.

    Weights shared between modules (a head tied to its embedding) stay shared: the sharded
    parameter of the first module replaces the other's.
    """
    from torch.distributed.tensor.parallel import parallelize_module

    given = {k: style(v) if isinstance(v, str) else v for k, v in (extra or {}).items()}
    own = collect_plan(model, sequence_parallel, loss_parallel, skip=list(given))
    # an entry given here replaces the modules' own entries for every name it matches
    own = {name: s for name, s in own.items() if not any(matches(p, name) for p in given)}
    plan = {**own, **given}
    if not plan:
        return 0
    ties = _shared_parameters(model)
    parallelize_module(model, mesh, plan)
    if sequence_parallel:
        for module in model.modules():
            if hasattr(type(module), "pad") and hasattr(type(module), "multiple"):
                module.multiple = mesh.size()  # SequenceSplit: sequences split evenly
    for owner, others in ties.items():
        shared = _get(model, owner)
        for other in others:
            module_name, _, attr = other.rpartition(".")
            setattr(model.get_submodule(module_name) if module_name else model, attr, shared)
    return len(plan)


def _shared_parameters(model: nn.Module) -> dict[str, list[str]]:
    first: dict[int, str] = {}
    ties: dict[str, list[str]] = {}
    for module_name, module in model.named_modules():
        for attr, param in module.named_parameters(recurse=False):
            name = f"{module_name}.{attr}" if module_name else attr
            if id(param) in first:
                ties.setdefault(first[id(param)], []).append(name)
            else:
                first[id(param)] = name
    return ties


def _get(model: nn.Module, name: str) -> nn.Parameter:
    module_name, _, attr = name.rpartition(".")
    return getattr(model.get_submodule(module_name) if module_name else model, attr)
