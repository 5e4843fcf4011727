"""One rank of an N-process job, run in this process without its memory or its peers.

The rank joins torch's `fake` process group (every collective returns at once, nothing is
sent), the task is built under `FakeTensorMode` (tensors have shapes, dtypes and devices but no
storage), and the strategy's own `parallelize` runs on it: the same mesh, pipeline cut, tensor
plans and FSDP2 units the worker would build. One training step then runs on a batch of the
configured shape (forward, the task's loss, backward, the optimizer's step) under torch's
`MemTracker`, which records the bytes every live tensor would take. Forward and backward are
measured apart from the optimizer's step: the activations are freed before the step allocates its
temporaries, and each phase has its own peak. A shape that does not split, a plan that does not
apply or a stage that cannot run fails here as it would in the worker.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from omegaconf import DictConfig

from framework.parallel.context import plan_of
from framework.preflight import fakes
from framework.preflight.fakes import copyable_fakes, fake_mode, fake_world
from framework.preflight.optimizer_work import exchange_bytes, muon_bytes
from framework.preflight.pipeline_rank import in_flight, pipeline_cut, stage_steps

log = logging.getLogger("framework.preflight")


@dataclass
class RankMemory:
    """Bytes one rank holds: model states (exact, from its shards) and, on top of them, the
    activations of forward and backward or the optimizer step's temporaries, whichever is larger
    (the one phase ends before the other begins)."""

    rank: int
    role: str
    params: int
    grads: int
    optimizer: int
    activations: int  # at forward and backward's peak, times a pipeline's microbatches in flight
    optimizer_step: int = 0  # what the optimizer's step allocates and frees (Adam's temporaries)
    note: str = ""
    # calls that cost the host time (framework.preflight.counting.host_counting): forward and
    # backward of one microbatch, and the optimizer step's with the prefix optimizer_
    host: dict[str, int] = field(default_factory=dict)
    # the optimizer step's matmul FLOPs by dtype (Muon's Newton-Schulz) and how many matmuls,
    # and the bytes its step sends (Muon's exchange): framework/preflight/optimizer_work.py
    optimizer_flops: dict[str, float] = field(default_factory=dict)
    optimizer_matmuls: int = 0
    optimizer_sent: float = 0.0
    muon_bytes: int = 0  # the bytes of the matrices Muon steps that the rank holds

    @property
    def model_states(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> int:
        """The peak of a step in steady state (the optimizer state exists from the second step
        on): forward and backward's, or the optimizer step's own if that is higher."""
        return self.model_states + max(self.activations, self.optimizer_step)


def local_bytes(tensors) -> int:
    """Bytes of this rank's part of each tensor (a DTensor's local shard), each counted once."""
    from torch.distributed.tensor import DTensor

    seen, total = set(), 0
    for t in tensors:
        if t is None or not torch.is_tensor(t):
            continue
        if id(t) in seen:  # a tied weight, once
            continue
        seen.add(id(t))
        part = t.to_local() if isinstance(t, DTensor) else t
        total += part.numel() * part.element_size()
    return total


def build_fake_task(task_cfg: DictConfig, mode, precision: str):
    from framework.instantiate import build_task

    with mode or contextlib.nullcontext(), copyable_fakes():  # None: real tensors
        task = build_task(task_cfg)
        if precision in ("bf16-true", "16-true", "64-true"):
            task = task.to(
                {"bf16": torch.bfloat16, "16": torch.float16, "64": torch.float64}[
                    precision.split("-")[0]
                ]
            )
    return task


def autocast(precision: str):
    if precision in ("bf16-mixed", "16-mixed"):
        dtype = torch.bfloat16 if precision.startswith("bf16") else torch.float16
        return torch.autocast("cpu", dtype=dtype)
    return contextlib.nullcontext()


def optimizer_of(task, cuda: bool) -> Any:
    """The task's optimizer, stepping as it would on the job's device (see `step_as_on_cuda`)."""
    from framework.parallel.placement import per_parameter_where_mixed
    from framework.task import TaskModule

    if isinstance(task, TaskModule):
        built = task.make_optimizer()
    else:
        built = task.configure_optimizers()
        if isinstance(built, dict):
            built = built["optimizer"]
        if isinstance(built, (list, tuple)):
            built = built[0]
            if isinstance(built, (list, tuple)):
                built = built[0]
    per_parameter_where_mixed([built])  # as the strategy does (framework.parallel.placement)
    if cuda:
        step_as_on_cuda(built)
    return built


def step_as_on_cuda(optimizer) -> None:
    """torch's optimizers left to choose (`foreach=None`) take their foreach form on CUDA, whose
    temporaries span all the parameters at once, and a loop over the parameters on the CPU, one
    parameter's at a time; fake tensors are CPU tensors, so the choice CUDA makes is set here."""
    for group in optimizer.param_groups:
        chosen = group.get("foreach", False) is not None or group.get("fused")
        if not chosen and not group.get("differentiable"):
            group["foreach"] = True


def step(
    task, optimizer, run_backward, precision: str, mode=None
) -> tuple[int | None, int, int, int, dict, Any]:
    """One step under MemTracker, in two phases: (activations at forward and backward's peak,
    the optimizer step's temporaries, grads' bytes, optimizer state's bytes, the host's calls
    of each phase, the optimizer step's matmuls: optimizer_work.matmul_counting). A step whose
    shapes depend on the data (a mixture-of-experts layer's tokens per expert) cannot run
    forward on fake tensors: then the activations are None and the optimizer steps on zero
    gradients."""
    from framework.preflight.counting import host_counting
    from framework.preflight.optimizer_work import matmul_counting

    counter = host_counting()
    try:
        with autocast(precision), fakes.fake_on(mode):
            peak, _ = tracked(task, optimizer, counted(counter, run_backward))
        held = activations(peak)
    except fakes.data_dependent() as err:
        log.info("fw check: %s has data-dependent shapes; model states only", type(err).__name__)
        held = None
        zero_gradients(task)
    grads = local_bytes(p.grad for p in task.parameters())
    stepping, matmuls = host_counting(), matmul_counting()
    run_step = counted(stepping, counted(matmuls, optimizer_step(task, optimizer)))
    peak, after = tracked(task, optimizer, run_step)
    states = local_bytes(v for s in optimizer.state.values() for v in s.values())
    host = {**counter.counts(), **{f"optimizer_{k}": n for k, n in stepping.counts().items()}}
    return held, max(0, peak["total"] - after["total"]), grads, states, host, matmuls


def optimizer_step(task, optimizer):
    """What runs once per optimizer step: the routers' balance (an all-reduce per MoE layer,
    as the strategy's `before_optimizer_step`), then the optimizer's step."""
    from framework.parallel.experts import balance, moe_layers

    layers = moe_layers(task)

    def run():
        if layers:
            balance(layers, None)
        optimizer.step()

    return run


def counted(counter, run):
    """`run` under `counter` (a dispatch mode), entered inside MemTracker's: a mode entered
    outside it sees DTensor operations only as their local ones."""

    def run_counted():
        with counter:
            return run()

    return run_counted


def zero_gradients(task) -> None:
    """The gradients a backward would leave, for a step whose forward could not run."""
    from torch.distributed.fsdp import FSDPModule

    for module in task.modules():  # the forward stopped with parameters gathered
        if isinstance(module, FSDPModule):
            module.reshard()
    for p in task.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)


def tracked(task, optimizer, run) -> tuple[dict[str, int], dict[str, int]]:
    """`run()` under its own MemTracker (the model's parameters, buffers and gradients and the
    optimizer's state tracked from before): bytes by kind, and their "total", at run's peak and
    when it has returned."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(task, optimizer)
    with tracker:
        run()
    return by_kind(tracker.get_tracker_snapshot("peak")), by_kind(tracker.get_tracker_snapshot())


def by_kind(snapshot) -> dict[str, int]:
    """A MemTracker snapshot summed over devices, keyed `param`, `grad`, `act`, ..., `total`."""
    found: dict[str, int] = {}
    for kinds in snapshot.values():
        for kind, n in kinds.items():
            name = str(kind).rsplit(".", 1)[-1].lower()
            found[name] = found.get(name, 0) + int(n)
    found.setdefault("total", 0)
    return found


def whole_step(task, batch, loss_parallel: bool, sequences=None):
    """The task's own training_step (its logging has no Trainer here and is skipped); with a
    context-parallel plan (`sequences`) on this rank's chunks of the batch, as the strategy runs
    it."""
    from framework.parallel.context import running

    def run():
        context = contextlib.nullcontext()
        if loss_parallel:
            from torch.distributed.tensor.parallel import loss_parallel as parallel_loss

            context = parallel_loss()
        with context, running(sequences):
            step_batch = sequences.split(batch) if sequences is not None else batch
            out = task.training_step(step_batch, 0)
            loss = out["loss"] if isinstance(out, dict) else out
            full = getattr(loss, "full_tensor", None)
            loss.backward()
            return full

    return run


def replica_rank(
    task_cfg, trainer_cfg, batch, rank: int, world_size: int, transforms, cuda: bool
) -> RankMemory:
    """A rank that holds the whole model (ddp, and DeepSpeed before its own sharding)."""
    mode = fake_mode()
    precision = trainer_cfg.precision
    with fake_world(rank, world_size), _quiet_logging():
        task = build_fake_task(task_cfg, mode, precision)
        transforms.apply(task)
        optimizer = optimizer_of(task, cuda)
        run = whole_step(task, fakes.fake_batch(mode, batch), False)
        held, temporaries, grads, states, host, matmuls = step(
            task, optimizer, run, precision, mode
        )
    params = local_bytes(task.parameters())
    note = UNSIMULATED if held is None else ""
    return RankMemory(
        rank, "every rank", params, grads, states, held or 0, temporaries, note, host,
        matmuls.flops, matmuls.calls, exchange_bytes(optimizer), muon_bytes(optimizer),
    )  # fmt: skip


def activations(peak: dict[str, int]) -> int:
    """What forward and backward's peak holds besides parameters, gradients and optimizer state:
    saved activations, temporaries (a gradient not yet in `.grad` too), gathered FSDP parameters,
    buffers."""
    return sum(n for kind, n in peak.items() if kind in ("act", "temp", "buffer", "oth"))


UNSIMULATED = "activations not simulated: the step's shapes depend on the data"


@contextlib.contextmanager
def _quiet_logging():
    """Lightning warns that `self.log` has no Trainer; the check has none by design."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*self.log.*")
        warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
        warnings.filterwarnings("ignore", message=".*not attached to a `Trainer`.*")
        yield


def parallel_rank(
    task_cfg, trainer_cfg, batch, rank: int, cfg, dims, transforms, cuda: bool
) -> RankMemory:
    """A rank of the parallel strategy: the worker's own mesh, cut, plans and FSDP units."""
    from framework.preflight.counting import REAL_COUNT_PARAMS, fsdp_units, real_calls

    mode = fake_mode()
    precision = trainer_cfg.precision
    built = (task_cfg, trainer_cfg, batch, rank, cfg, dims, transforms, cuda)
    with fake_world(rank, dims.world_size), _quiet_logging():
        task, optimizer, run, role, flight = rank_step(*built, mode)
        held, temporaries, grads, states, host, matmuls = step(
            task, optimizer, run, precision, mode
        )
        host["fsdp_units"] = fsdp_units(task)
        if held is None and sum(p.numel() for p in task.parameters()) <= REAL_COUNT_PARAMS:
            # shapes that depend on the data (routed experts): forward and backward's calls
            # counted on real tensors, on the same fake process group
            real = [autocast(precision), fakes.mirrored_all_to_all()]
            host.update(real_calls(rank_step(*built, None)[2], real))
    params = local_bytes(task.parameters())
    note = f"x{flight} microbatches in flight" if flight > 1 else ""
    if held is None:
        note = UNSIMULATED
    activations_held = (held or 0) * flight
    return RankMemory(
        rank, role, params, grads, states, activations_held, temporaries, note, host,
        matmuls.flops, matmuls.calls, exchange_bytes(optimizer), muon_bytes(optimizer),
    )  # fmt: skip


def rank_step(task_cfg, trainer_cfg, batch, rank, cfg, dims, transforms, cuda, mode):
    """The rank's task made parallel (on fake tensors of `mode`, or real ones for None), its
    optimizer, its step (forward and backward), its role and its microbatches in flight."""
    from framework.parallel.parallelize import parallelize

    coords = dims.coordinates(rank)
    task = build_fake_task(task_cfg, mode, trainer_cfg.precision)
    mesh = dims.build_mesh("cpu")
    batch = batch if mode is None else fakes.fake_batch(mode, batch)
    cut, inputs = before_parallelize(task, cfg, dims, coords, batch)
    tensor, fsdp = settings(task, cfg, dims, cut)
    stages = parallelize(
        task, mesh, dims, tensor, fsdp, transforms, cut, torch.device("cpu"), cfg.cp_mode
    )
    optimizer = optimizer_of(task, cuda)
    where = " ".join(f"{k}{v}" for k, v in coords.items() if getattr(dims, k) > 1)
    if dims.cp > 1:
        where += f" cp{coords['fsdp'] % dims.cp}"
    if cut is None:
        run = whole_step(task, batch, tensor.loss_parallel and dims.tp > 1, plan_of(task))
        return task, optimizer, run, where, 1
    run = stage_steps(task, stages, inputs, cut)
    role = f"stage {'+'.join(str(s) for s in cut.mine)} ({where})"
    return task, optimizer, run, role, in_flight(cfg, dims, coords["pp"])


def before_parallelize(task, cfg, dims, coords, batch):
    """What the strategy does to the built task before `parallelize`, in its order: the
    model families' MoE blocks swapped for framework layers (ep > 1, its setup_environment: the
    stages and the tensor plans then see the swapped blocks, whose experts ep splits), then the
    pipeline cut (pp > 1). Returns (cut, each stage's input) as `pipeline_cut`, or (None, {})."""
    from framework.parallel.model import adapter_for

    if dims.ep > 1:
        adapter_for(task).swap_experts(task, dims.ep)
    return (None, {}) if dims.pp == 1 else pipeline_cut(task, cfg, dims, coords, batch)


def settings(task, cfg, dims, cut):
    """The tensor-parallel and FSDP settings the strategy's setup gives `parallelize` (the same
    function), with offloaded states counted on the device: an upper bound."""
    from framework.parallel.settings import parallel_settings

    return parallel_settings(task, cfg, dims, cut, cpu_offload=False)
