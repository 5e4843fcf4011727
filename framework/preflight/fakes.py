"""The fake world a simulated rank runs in: torch's `fake` process group and fake tensors
(framework/preflight/simulate.py)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist


@contextlib.contextmanager
def fake_world(rank: int, world_size: int):
    """This process as rank `rank` of `world_size` on the fake backend, for the block's span."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()
        forget_meshes()


def forget_meshes() -> None:
    """Drop DTensor's caches of sharding and redistribution plans: they compare meshes by shape
    and names, so the next rank's equal mesh would reuse this rank's (destroyed) groups."""
    from torch.distributed.tensor import _redistribute, debug

    debug._clear_sharding_prop_cache()
    cached = getattr(_redistribute._gen_transform_infos, "cache_clear", None)
    if cached is not None:
        cached()
    getattr(_redistribute, "_planner_cache", {}).clear()


def fake_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


@contextlib.contextmanager
def copyable_fakes():
    """`copy.deepcopy` of a fake tensor gives a fake clone while the task is built. Tensor's own
    deepcopy rebuilds the storage on the tensor's device, which a fake tensor (backed by meta)
    refuses; metrics deepcopy their default states when built (torchmetrics' `add_state`)."""
    from torch._subclasses.fake_tensor import FakeTensor

    own = FakeTensor.__dict__.get("__deepcopy__")
    FakeTensor.__deepcopy__ = lambda self, memo: (
        self.detach().clone().requires_grad_(self.requires_grad)
    )
    try:
        yield
    finally:
        if own is None:
            del FakeTensor.__deepcopy__
        else:
            FakeTensor.__deepcopy__ = own


@contextlib.contextmanager
def mirrored_all_to_all():
    """On the fake process group with real tensors (a step whose shapes depend on its data), the
    functional all-to-all returns what this rank sends, as if every rank sent the same: its
    received sizes then match, and the routed experts' step runs. Each all-to-all is still
    issued on the group (the fake one returns at once), forward and backward, so it is counted."""
    from torch.distributed import _functional_collectives as functional

    issued = functional.all_to_all_single

    def mirrored(x, output_split_sizes, input_split_sizes, group, tag=""):
        out = issued(x, input_split_sizes, input_split_sizes, group, tag)
        return out + (x - out).detach()  # x's values; gradients flow back through `out`

    functional.all_to_all_single = mirrored
    try:
        yield
    finally:
        functional.all_to_all_single = issued


def fake_batch(mode, batch: Any) -> Any:
    if torch.is_tensor(batch):
        return mode.from_tensor(batch)
    if isinstance(batch, (list, tuple)):
        return type(batch)(fake_batch(mode, b) for b in batch)
    if isinstance(batch, dict):
        return {k: fake_batch(mode, v) for k, v in batch.items()}
    return batch


def fake_on(mode):
    """The task's fake mode, on for forward and backward and entered before MemTracker (which
    then still sees every operation first): tensors the step creates from no input are fake
    too, FSDP's all-gather and reduce-scatter buffers among them. Left real, a Llama-3-8B's
    gathered layers took gigabytes of this process's memory and real time to cast. The
    optimizer's step stays outside it (it reads its step counts, real scalars, as numbers)."""
    return contextlib.nullcontext() if mode is None else mode


def data_dependent() -> tuple[type[Exception], ...]:
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
    )
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    return DataDependentOutputException, DynamicOutputShapeException, GuardOnDataDependentSymNode
