"""`parallelize`: the one place where a task is made parallel, in a fixed order.

1. pipeline cut (pp > 1): this rank keeps only its stages' layers; then the float8 swap of its
   linear layers (`trainer.float8`, framework/parallel/float8.py), before any of them is split;
2. tensor-parallel plans on the `tp` view (tp > 1);
3. expert parallel on the `ep` view (ep > 1): each rank keeps its share of every MoE layer's
   experts (framework/parallel/experts.py); context parallel on the `cp` view (cp > 1): the
   attention modules get the plan by which they reach the other chunks of their sequences
   (framework/parallel/context; a model family's own attention through its adapter,
   framework/parallel/model.py; no parameter changes);
4. activation checkpointing and compile, per block;
5. FSDP2 over the data views (dp x fsdp > 1): shard over `fsdp`, replicate over `dp` (hybrid
   when both are above 1), with the pipeline stages as roots under a pipeline; the experts of
   step 3 are sharded over `efsdp` (the ranks holding the same experts) as units of their own;
6. everything steps 2-5 did not place moved to the rank's device (framework/parallel/placement.py):
   last, so a GPU never holds more than this rank's share of the model.

Every rank builds the whole model from the seed before this (initial weights are one process's),
and no step renames a module or parameter, so checkpoints of any layout read back by name.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from framework.parallel import pipeline
from framework.parallel.context import apply_context_parallel
from framework.parallel.dims import JobMesh, ParallelDims
from framework.parallel.fsdp import FSDPSettings, apply_fsdp, shard_experts
from framework.parallel.model import adapter_for
from framework.parallel.tensor import apply_tensor_parallel
from framework.parallel.transforms import ModelTransforms


@dataclass(frozen=True)
class TensorParallelSettings:
    """How tensor parallel splits the task (see framework.parallel.tensor)."""

    plan: dict[str, str] = field(default_factory=dict)  # extra 'module: style' entries
    sequence_parallel: bool = False
    loss_parallel: bool = False


@dataclass(frozen=True)
class StageCut:
    """Where the model's layer chain is cut, and which stages this rank runs."""

    chain: list[pipeline.Layer]
    starts: list[int]  # first layer of each stage
    mine: list[int]  # stage ids of this rank

    def layers(self, stage: int) -> list[pipeline.Layer]:
        return pipeline.stage_layers(self.chain, self.starts, stage)


def parallelize(
    task: nn.Module,
    mesh: JobMesh,
    dims: ParallelDims,
    tensor: TensorParallelSettings,
    fsdp: FSDPSettings,
    transforms: ModelTransforms,
    cut: StageCut | None = None,
    device: torch.device | None = None,
    cp_mode: str = "ring",
) -> dict[int, nn.Module]:
    """Make `task` parallel in place, every tensor of it on `device` (None: left where it is);
    returns this rank's stage modules by id (pp > 1), else {}. `cp_mode`: context-parallel
    attention (cp > 1), one of framework.parallel.context.MODES."""
    from framework.parallel.experts import apply_expert_parallel
    from framework.parallel.placement import to_device

    if cut is not None:
        kept = [layer for s in cut.mine for layer in cut.layers(s)]
        pipeline.keep_only(task, cut.chain, kept)
    transforms.convert_float8(task, fsdp_all_gather=dims.shard_size > 1)
    if dims.tp > 1:
        apply_tensor_parallel(
            task,
            mesh["tp"],
            tensor.plan,
            sequence_parallel=tensor.sequence_parallel,
            loss_parallel=tensor.loss_parallel,
        )
    experts = apply_expert_parallel(task, mesh["ep"]) if dims.ep > 1 else set()
    if dims.cp > 1:
        plan = apply_context_parallel(task, mesh["cp"].get_group(), cp_mode)
        # a model family's own attention, positions and labels follow it (transformers')
        adapter_for(task).attach_context(task, plan)
    transforms.apply(task)
    stages = {s: pipeline.Stage(task, cut.layers(s)) for s in cut.mine} if cut else {}
    # the ranks holding the same experts shard them; with one such rank too when a mixed
    # precision is set, else the experts would stay fp32 while FSDP feeds them param_dtype inputs
    if experts and (mesh["efsdp"].size() > 1 or fsdp.param_dtype or fsdp.reduce_dtype):
        shard_experts(task, mesh["efsdp"], fsdp)
        experts = set()  # now FSDP units of their own: the outer units leave them out anyway
    if dims.shard_size > 1:
        data = mesh[("dp", "fsdp")] if dims.dp > 1 else mesh["fsdp"]
        apply_fsdp(task, data, fsdp, roots=list(stages.values()) if cut else None, ignored=experts)
    if device is not None:
        to_device(task, device)  # a stage holds the task's own modules: they move with it
    return stages
