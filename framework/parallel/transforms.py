"""The model transforms every strategy applies the same way: float8 linear layers
(framework/parallel/float8.py), then activation checkpointing and torch.compile per block.

Blocks are the task's layers (`layers`, as its model family names them: a transformers model's
decoder layers, else the members of every `nn.ModuleList`); a model without any has its
top-level children taken instead. Both transforms replace a block's `forward` in place, so module and parameter names, and therefore checkpoints, do not change. The block's
forward is compiled first and the checkpoint wraps the compiled function: compiling through the
checkpoint fails for tensor-parallel (DTensor) blocks in the installed torch. They run after
tensor parallelism and before data-parallel wrapping (DDP, ZeRO, FSDP2) in every strategy. The
float8 swap comes first: before tensor parallelism (`parallelize` calls `convert_float8` ahead
of its plans), else at the start of `apply`.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from framework.parallel.float8 import Float8Settings, convert

log = logging.getLogger("framework.nn")


def layers(task: nn.Module) -> list[nn.Module]:
    """The model's layers, as its model family names them (framework/parallel/model.py: a
    transformers model's decoder layers, its `_no_split_modules`), else every `nn.ModuleList`
    member (not the ones a pipeline stage dropped, which are None)."""
    from framework.parallel.model import adapter_for

    return adapter_for(task).blocks(task)


def blocks(task: nn.Module) -> list[nn.Module]:
    found = layers(task)
    return found or [m for m in task.children() if any(True for _ in m.parameters())]


def _selective_policy():
    from torch.utils.checkpoint import CheckpointPolicy

    aten, c10d = torch.ops.aten, torch.ops._c10d_functional
    save = {
        aten.mm.default,
        aten.addmm.default,
        aten.bmm.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_flash_attention.default,
        c10d.all_reduce.default,
        c10d.reduce_scatter_tensor.default,
        c10d.all_gather_into_tensor.default,
    }

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def keep_no_cache(task: nn.Module) -> None:
    """Every model family makes its modules safe to recompute (transformers models keep no
    key/value cache in training: framework/integrations/hf/adapter.py)."""
    from framework.parallel.model import adapter_for

    adapter_for(task).before_checkpointing(task)


def checkpoint_block(block: nn.Module, mode: str) -> None:
    """Recompute the block's activations in backward (`block.forward` may already be compiled:
    the checkpoint stays outside the compiled code, which works also with DTensor blocks)."""
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    inner = block.forward
    context = None
    if mode == "selective":
        policy = _selective_policy()
        context = functools.partial(create_selective_checkpoint_contexts, policy)

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        if not torch.is_grad_enabled():
            return inner(*args, **kwargs)
        extra = {"context_fn": context} if context is not None else {}
        return checkpoint(inner, *args, use_reentrant=False, **extra, **kwargs)

    block.forward = forward


@dataclass
class ModelTransforms:
    """What the worker hands every strategy from `trainer.*`: float8 linear layers,
    activation checkpointing and compile of the task's blocks."""

    activation_checkpointing: str = "none"
    compile: bool = False
    float8: Float8Settings = field(default_factory=Float8Settings)

    def convert_float8(self, task: nn.Module, fsdp_all_gather: bool = False) -> int:
        """The float8 swap alone, before tensor parallelism and FSDP (`fsdp_all_gather`: FSDP2
        will shard the layers); returns the layers converted (none again on a second call)."""
        return convert(task, self.float8, fsdp_all_gather)

    def apply(self, task: nn.Module) -> int:
        """Transform `task` in place: float8 layers (unless converted already), then every
        block; returns how many blocks."""
        self.convert_float8(task)
        if self.activation_checkpointing == "none" and not self.compile:
            return 0
        found = blocks(task)
        if self.activation_checkpointing != "none":
            keep_no_cache(task)
        for block in found:
            if self.compile:
                block.forward = torch.compile(block.forward)
            if self.activation_checkpointing != "none":
                checkpoint_block(block, self.activation_checkpointing)
        log.debug(
            "%d blocks: activation checkpointing %s, compile %s",
            len(found),
            self.activation_checkpointing,
            self.compile,
        )
        return len(found)
