"""Context parallel: each sequence split over the `cp` ranks, attention computed across them.

The ranks of a context-parallel group read the same batch. Each keeps two of the sequence's
`2 x cp` equal chunks, chunk `r` and chunk `2cp-1-r` ("zigzag"): under a causal mask early
positions attend to few keys and late ones to many, so a head chunk paired with a tail chunk
gives every rank the same attention work. Inputs, targets and position ids follow the same split
(`split_batch`, `ContextPlan.positions`); everything but attention is per position and runs on
the local chunks unchanged. Attention needs the keys and values of the whole sequence, by one of
three modes:

- `allgather`: K/V all-gathered once per layer; simplest, holds the whole sequence's K/V;
- `ring`: K/V blocks passed around the group (cp-1 sends), each block's partial attention merged
  by its log-sum-exp (online softmax); with the zigzag split a block from an earlier rank is seen
  by all local queries through its head chunk only, one from a later rank by the local tail
  chunk only, so no step but the first needs a mask;
- `ulysses`: an all-to-all turns the sequence split into a head split (heads / cp per rank, the
  whole sequence), attention runs as on one process, and a second all-to-all turns it back.

The attention and its collectives are in framework/parallel/context/attention.py, each block's
fused kernel (CPU, CUDA flash or memory-efficient) in kernels.py. `parallelize` gives
every module with a `context` attribute (framework.nn.Attention, SequenceSplit) one shared
`ContextPlan`; the strategy turns it on for the training and validation steps (`running`), so
the same model run outside them (sampling at the end of training) attends as on one process.

The loss: a rank's chunks may hold more or fewer ignored target tokens than another's, so a mean
of per-chunk means is not the mean over the sequences' tokens. `cross_entropy` divides this
rank's summed loss by the token count of the whole group (summed over the cp ranks) times cp:
the mean over the cp ranks of what it returns (what the logged value and FSDP's gradient average
take) is the group's token mean.
"""

from __future__ import annotations

import contextlib
import inspect
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from framework.errors import ConfigError
from framework.parallel.context.attention import (  # noqa: F401 (zigzag_order: API)
    split_attention,
    ulysses_attention,
    zigzag_index,
    zigzag_order,
)

MODES = ("ring", "allgather", "ulysses")
# the plan in force within `running` (what `cross_entropy` counts over); None outside
IN_FORCE: ContextVar[ContextPlan | None] = ContextVar("context_plan", default=None)


@dataclass
class ContextPlan:
    """How this rank's attention reaches the rest of its sequence (one object per model)."""

    mode: str
    group: Any  # the cp ranks' process group
    size: int
    rank: int
    active: bool = False  # on during the strategy's steps only (see `running`)

    def positions(self, local_length: int, device) -> torch.Tensor:
        """Position ids of this rank's tokens."""
        return zigzag_index(local_length * self.size, self.size, self.rank, device)

    def split(self, batch: Any) -> Any:
        """This rank's chunks of every tensor of `batch` with 2 or more dimensions (dim 1 is the
        sequence); other values as they are."""
        if torch.is_tensor(batch):
            if batch.dim() < 2:
                return batch
            length = batch.shape[1]
            if length % (2 * self.size):
                raise ValueError(
                    f"context parallel (strategy.cp={self.size}) splits each sequence into "
                    f"2 x cp = {2 * self.size} equal chunks: a batch of sequences of {length} "
                    f"positions ({tuple(batch.shape)}) does not split; give the data module "
                    f"a sequence length that is a multiple of {2 * self.size}"
                )
            index = zigzag_index(length, self.size, self.rank, batch.device)
            return batch.index_select(1, index)
        if isinstance(batch, (list, tuple)):
            return type(batch)(self.split(b) for b in batch)
        if isinstance(batch, dict):
            return {k: self.split(v) for k, v in batch.items()}
        return batch

    def attention(self, q, k, v, causal: bool = True) -> torch.Tensor:
        """Attention of the local queries (batch, heads, local positions, head_dim) over the
        whole sequence's keys and values."""
        if self.mode == "ulysses":
            return ulysses_attention(q, k, v, causal, self.group, self.size)
        return split_attention(q, k, v, causal, self.mode, self.group, self.size, self.rank)


@contextlib.contextmanager
def running(plan: ContextPlan | None):
    """The plan in force for the block's span (nothing to do without one)."""
    if plan is None:
        yield
        return
    before, plan.active = plan.active, True
    token = IN_FORCE.set(plan)
    try:
        yield
    finally:
        IN_FORCE.reset(token)
        plan.active = before


def cross_entropy(logits, targets, ignore_index: int = -100) -> torch.Tensor:
    """F.cross_entropy's mean over the target tokens that are not `ignore_index` (logits
    (..., classes), targets (...)), counted over whole sequences: within `running`, this rank's
    summed loss over the token count of its cp group divided by cp (so the mean over the group's
    ranks is the group's token mean; a group with no target token gives 0). Elsewhere exactly
    F.cross_entropy."""
    logits, targets = logits.reshape(-1, logits.size(-1)), targets.reshape(-1)
    plan = IN_FORCE.get()
    if plan is None or plan.size == 1:
        return F.cross_entropy(logits, targets, ignore_index=ignore_index)
    total = F.cross_entropy(logits, targets, ignore_index=ignore_index, reduction="sum")
    count = (targets != ignore_index).sum()
    dist.all_reduce(count, group=plan.group)
    # a tensor, not a number: fw check runs this on fake tensors, whose values are unknown
    divisor = count.clamp(min=1).to(total.dtype) / plan.size
    mesh = getattr(total, "device_mesh", None)  # a DTensor under tensor parallel's loss_parallel
    if mesh is not None:
        from torch.distributed.tensor import DTensor, Replicate

        divisor = DTensor.from_local(divisor, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return total / divisor


def apply_context_parallel(model: nn.Module, group, mode: str) -> ContextPlan:
    """Give every module of `model` with a `context` attribute one plan over `group`."""
    plan = ContextPlan(mode, group, dist.get_world_size(group), dist.get_rank(group))
    for module in model.modules():
        if hasattr(module, "context"):
            module.context = plan
    return plan


def plan_of(model: nn.Module) -> ContextPlan | None:
    for module in model.modules():
        if getattr(module, "context", None) is not None:
            return module.context
    return None


# ---- checks before launch (in the fw process)


def check_lengths(task_class: type, model_args: dict, cp: int) -> None:
    """The sequence lengths the task names (its `context_parallel_dims`) split into 2 x cp
    chunks."""
    lengths = getattr(task_class, "context_parallel_dims", None)
    if lengths is not None:
        check_split("task.model", lengths(model_args), cp)


def check_split(prefix: str, lengths: dict, cp: int, hint: str = "") -> None:
    """ConfigError naming `prefix.key` for the first length of {key: length} that 2 x cp does
    not divide (values that are not integers are left alone)."""
    for key, value in lengths.items():
        if isinstance(value, int) and not isinstance(value, bool) and value % (2 * cp):
            raise ConfigError(
                f"{prefix}.{key}",
                value,
                f"context parallel splits each sequence into 2 x cp = {2 * cp} equal chunks "
                f"(strategy.cp={cp}), which must divide this sequence length",
                hint=f"Choose a multiple of {2 * cp}, or another strategy.cp.{hint}",
            )


# data module arguments read as the length of its sequences, unless the data module names its
# own by a static `context_parallel_dims(args)` (as a task does for its model's arguments)
SEQUENCE_KEYS = (
    "block_size",
    "length",
    "seq_len",
    "seq_length",
    "sequence_length",
    "max_seq_len",
    "max_seq_length",
    "context_length",
)


def check_data_lengths(data_class: type, data_args: dict, cp: int) -> None:
    """The sequence lengths the data module's settings give (given or by default) split into
    2 x cp chunks: those its `context_parallel_dims(args)` names, else its arguments named
    like a sequence length (SEQUENCE_KEYS). The lengths a batch actually has are checked again
    at the first step (`ContextPlan.split`)."""
    declared = getattr(data_class, "context_parallel_dims", None)
    if declared is not None:
        lengths = declared(data_args)
    else:
        try:
            parameters = inspect.signature(data_class).parameters.values()
        except (TypeError, ValueError):
            parameters = []
        defaults = {p.name: p.default for p in parameters if p.default is not p.empty}
        given = {**defaults, **data_args}
        lengths = {k: given[k] for k in SEQUENCE_KEYS if k in given}
    # the data module's own settings may hold another kind of length: say how to name them
    hint = (
        " (If the setting is not the sequence length, the data module can name its lengths by "
        "a static context_parallel_dims(args) returning {setting: length}.)"
    )
    check_split("task.data", lengths, cp, hint)


def check_model(model: nn.Module, cp: int, mode: str, tp: int = 1) -> None:
    """The model's attention can be split over the sequence: framework.nn attention (a module
    with a `context` attribute) and no other attention; heads that split for ulysses."""
    name = type(model).__name__
    splittable = [(n, m) for n, m in model.named_modules() if hasattr(m, "context")]
    other = [
        (n, m)
        for n, m in model.named_modules()
        if "attention" in type(m).__name__.lower() and not hasattr(m, "context")
    ]
    if other:
        where, module = other[0]
        raise ConfigError(
            "strategy.cp",
            cp,
            f"{where} ({type(module).__name__}) of {name} is an attention context parallel "
            "cannot split over the sequence",
            [1],
            hint="Build attention from framework.nn.Attention, or use strategy.cp=1.",
        )
    attention = [(n, m) for n, m in splittable if hasattr(m, "n_head")]
    if not attention:
        raise ConfigError(
            "strategy.cp",
            cp,
            f"{name} has no attention context parallel can split (framework.nn.Attention): "
            "its sequences would be cut with nothing to join them",
            [1],
        )
    for where, module in attention:
        if module.dropout:
            raise ConfigError(
                "strategy.cp",
                cp,
                f"{where} drops attention weights (dropout={module.dropout}), which context "
                "parallel does not apply",
                [1],
                hint="Set the model's dropout to 0, or use strategy.cp=1.",
            )
        heads = module.n_head // tp
        if mode == "ulysses" and heads % cp:
            raise ConfigError(
                "strategy.cp",
                cp,
                f"cp_mode=ulysses splits the heads over the cp ranks: {where} has {heads} heads "
                f"per tensor-parallel rank, which cp does not divide",
                [d for d in range(1, heads + 1) if heads % d == 0],
                hint="Use cp_mode=ring or allgather, or a cp that divides the heads.",
            )
