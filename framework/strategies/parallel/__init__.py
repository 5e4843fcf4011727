"""`strategy=fsdp|tensor|fsdp_tp|pipeline|expert`, or any degrees: pipeline, data, sharded-data,
tensor and expert parallel on one DeviceMesh.

The degrees `pp`, `dp`, `fsdp` and `tp` multiply to the number of processes; one of them may be -1
("the rest"). The presets only set degrees: `fsdp` is `fsdp: -1`, `tensor` is `tp: -1`, `fsdp_tp`
is `fsdp: -1, tp: 2`, `pipeline` is `pp: -1`; any other mix is written with the degrees, e.g.
`strategy=pipeline strategy.pp=2 strategy.fsdp=2`; `expert` is `fsdp: -1, ep: -1` (the experts
of mixture-of-experts layers split over all processes). `cp` splits each sequence over that many
of the fsdp ranks (context parallel: attention by `cp_mode`, framework/parallel/context/__init__.py). One `ParallelDims` builds one mesh
(framework/parallel/dims.py) and one `parallelize` applies, in this order: the pipeline cut,
tensor-parallel plans, activation checkpointing / compile, FSDP2 over the data ranks
(framework/parallel/parallelize.py).

Under a pipeline (pp > 1) each batch is split into `microbatches` and a schedule of
torch.distributed.pipelining runs them over the stages: `gpipe` (all forwards, then all
backwards), `1f1b` (one forward, one backward after a warm-up), `interleaved_1f1b`
(`virtual_stages` stages per process), `zero_bubble` (interleaved, backward split into input- and
weight-gradient parts) and `zbv` (zero bubble, two stages per process in a V). Checkpoints are DCP
directories (`dcp`; `dcp_flat` under a pipeline: optimizer state keyed per parameter).

With `fault_tolerance=torchft` (fsdp only) each `fw train` command is one replica group whose
processes shard the model; the groups average their gradient shards through torchft
(HSDP across groups that may fail: framework/replica_groups, framework/strategies/parallel/ft.py).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, fields
from typing import Any

from framework import replica_groups
from framework.config.fields import doc
from framework.errors import ConfigError
from framework.parallel.dims import ParallelDims
from framework.world import World, collective_backend

log = logging.getLogger("framework.parallel")
DTYPES = (None, "float32", "bfloat16", "float16")
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv")
CP_MODES = ("ring", "allgather", "ulysses")
BALANCE = ("params", "time")
LOOPED = ("interleaved_1f1b", "zero_bubble")  # several stages per process, placed round-robin
PIPELINE_FIELDS = ("schedule", "microbatches", "virtual_stages", "split_points", "balance", "trace")


@dataclass
class Config(replica_groups.TorchftSettings):
    """Degrees of pipeline (pp), data (dp), sharded data (fsdp) and tensor (tp) parallelism on
    one mesh, with the settings of each."""

    kind: str = doc("parallel", "Strategy plugin.")
    pp: int = doc(1, "Pipeline-parallel degree (-1: the processes left over).")
    dp: int = doc(1, "Replicated data-parallel degree (-1: the processes left over).")
    fsdp: int = doc(1, "Sharded data-parallel degree, FSDP2 (-1: the processes left over).")
    tp: int = doc(1, "Tensor-parallel degree (-1: the processes left over).")
    ep: int = doc(
        1,
        "Expert-parallel degree: MoE experts split over this many of the fsdp ranks "
        "(-1: all of them).",
    )
    cp: int = doc(
        1,
        "Context-parallel degree: each sequence split over this many of the fsdp ranks "
        "(-1: all of them); they read the same batch.",
    )
    cp_mode: str = doc(
        "ring",
        "Context-parallel attention: ring (K/V passed around the cp ranks, online-softmax "
        "merge), allgather (K/V gathered once per layer) or ulysses (all-to-all from sequence "
        "to heads; heads divisible by cp).",
        CP_MODES,
    )
    # FSDP2
    reshard_after_forward: bool = doc(True, "FSDP: free gathered parameters after forward.")
    param_dtype: str | None = doc(
        None, "FSDP: dtype of gathered parameters for compute (None: as stored).", DTYPES
    )
    reduce_dtype: str | None = doc(
        None, "FSDP: dtype gradients are reduced in (None: param_dtype).", DTYPES
    )
    cpu_offload: bool = doc(
        False, "FSDP: keep sharded parameters and optimizer state in CPU memory."
    )
    shard_modules: list[str] = doc(
        [], "FSDP: class names of the sharding units (empty: automatic)."
    )
    # tensor parallel
    sequence_parallel: bool = doc(
        False, "Split norms and dropout over the sequence between blocks (tp > 1, pp = 1)."
    )
    loss_parallel: bool = doc(
        True,
        "Leave an LMHead's logits split over the vocabulary and compute the task's cross-entropy "
        "without gathering them (tp > 1, pp = 1).",
    )
    tp_plan: list[str] = doc(
        [],
        "Extra plan entries 'module:style' (names may use * wildcards); styles in "
        "framework.parallel.tensor.STYLES, e.g. colwise, rowwise.",
    )
    # pipeline parallel
    schedule: str = doc("1f1b", "Pipeline schedule (pp > 1).", SCHEDULES)
    microbatches: int = doc(
        4, "Microbatches each batch is split into (must divide the batch).", min=1
    )
    virtual_stages: int = doc(
        1,
        "Stages per process: 1 for gpipe and 1f1b, 2 or more for the interleaved ones, 2 for zbv.",
        min=1,
    )
    split_points: list[str] = doc(
        [],
        "Modules where stages 2, 3, ... begin (e.g. [model.blocks.2]); empty: balanced by "
        "`balance`.",
    )
    balance: str = doc(
        "params",
        "How stages are balanced without split points: params (parameter count) or time "
        "(each layer's forward + backward timed on one microbatch of the first batch).",
        BALANCE,
    )
    trace: bool = doc(
        False, "Save a picture of the executed schedule (pipeline_schedule.png in the run dir)."
    )
    trace_step: int = doc(3, "The optimizer step whose schedule `trace` draws.", min=1)


def dims_of(cfg: Config, world_size: int) -> ParallelDims:
    """The resolved degrees; ConfigError when they do not fit the processes. Fitted once per
    process (a pure function of the degrees and the process count): `validate` asks first,
    and every later hook (the job plan's questions, `build`) gets that answer."""
    return _fitted(tuple(int(getattr(cfg, k)) for k in DEGREES), world_size)


DEGREES = ("pp", "dp", "fsdp", "tp", "ep", "cp")  # the Config fields ParallelDims.fit resolves


@functools.lru_cache(maxsize=32)
def _fitted(degrees: tuple[int, ...], world_size: int) -> ParallelDims:
    return ParallelDims.fit(dict(zip(DEGREES, degrees, strict=True)), world_size)


def plan_candidates(gpus: int, tp_limit: int) -> list[tuple[str, list[str]]]:
    """`fw plan` tries FSDP, FSDP x tensor parallel and pipelines of 2, 4 and 8 stages (with
    FSDP, and tensor parallel) over the degrees that divide `gpus`."""
    found = [("fsdp", ["strategy=fsdp"])]
    small = [d for d in (2, 4, 8) if gpus % d == 0 and d <= gpus]
    for tp in (d for d in small if d <= tp_limit):
        found.append((f"fsdp x tp{tp}", ["strategy=fsdp_tp", f"strategy.tp={tp}"]))
    for pp in small:
        stages = ["strategy=pipeline", f"strategy.pp={pp}", "strategy.fsdp=-1"]
        found.append((f"pp{pp} x fsdp", stages))
        for tp in (d for d in small if d <= tp_limit and pp * d <= gpus and gpus % (pp * d) == 0):
            found.append((f"pp{pp} x fsdp x tp{tp}", [*stages, f"strategy.tp={tp}"]))
    return found


def validate(cfg: Config, world: World, job: Any) -> None:
    from framework.strategies.parallel import checks

    dims = dims_of(cfg, world.world_size)
    collective_backend(cfg.backend, world)
    replica_groups.validate(cfg, world)
    if cfg.fault_tolerance == "torchft":  # before the layout's own (costlier) checks
        torchft_layout(dims)
    if cfg.cpu_offload and not world.is_cuda:
        raise ConfigError(
            "strategy.cpu_offload",
            cfg.cpu_offload,
            "offloading to the CPU needs the job to run on CUDA",
            ["false"],
        )
    checks.precision(job.trainer.precision)
    checks.plan_syntax(cfg.tp_plan)
    warn_unused(cfg, dims)
    if dims.pp > 1:
        checks.pipeline_settings(cfg, dims, job)
    if dims.tp > 1:
        checks.tensor_parallel(cfg, dims, job)
    checks.experts(cfg, dims, job)
    if dims.cp > 1:
        context_parallel(cfg, dims, job)


def torchft_layout(dims: ParallelDims) -> None:
    """torchft replica groups shard only over the group's processes (fsdp): a process's gradient
    shards must be those of the same rank in every other group, and no other degree is built."""
    for key in ("pp", "dp", "tp", "ep", "cp"):
        degree = getattr(dims, key)
        if degree != 1:
            raise ConfigError(
                f"strategy.{key}",
                degree,
                "strategy.fault_tolerance=torchft shards each replica group with fsdp over "
                "its processes only",
                ["1"],
                hint="Use strategy=fsdp (or strategy=ddp) with strategy.fault_tolerance=torchft.",
            )


def check_services(cfg: Config, world: World) -> None:
    if cfg.fault_tolerance == "torchft":  # `fw train` only: check and plan do not need it up
        replica_groups.contact_lighthouse(cfg.lighthouse)


def context_parallel(cfg: Config, dims: ParallelDims, job: Any) -> None:
    """cp > 1: sequence lengths that split into 2 x cp chunks, attention that splits
    (framework.parallel.context)."""
    from framework.config.validate import import_target
    from framework.parallel import context
    from framework.parallel.model import adapter_for
    from framework.strategies.parallel.checks import model_of

    task_class = import_target("task._target_", job.task._target_)
    context.check_lengths(task_class, dict(job.task.get("model", {})), dims.cp)
    data = job.task.get("data", {})
    if data.get("_target_"):  # the data module's sequence length, where its settings give it
        data_class = import_target("task.data._target_", data["_target_"])
        args = {k: v for k, v in data.items() if k != "_target_"}
        context.check_data_lengths(data_class, args, dims.cp)
    model = model_of(job)
    # a model family's own attention (transformers: through their registry), else the
    # attention modules that declare a `context`
    if not adapter_for(model).check_context(model, dims.cp, cfg.cp_mode, dims.tp):
        context.check_model(model, dims.cp, cfg.cp_mode, dims.tp)


def warn_unused(cfg: Config, dims: ParallelDims) -> None:
    """Settings that do nothing with these degrees are named, not silently dropped."""
    defaults = {
        f.name: f.default_factory() if callable(f.default_factory) else f.default
        for f in fields(Config)
    }
    unused = []
    if dims.pp == 1:
        unused += [f for f in PIPELINE_FIELDS if getattr(cfg, f) != defaults[f]]
    if dims.tp == 1:
        unused += [f for f in ("sequence_parallel", "tp_plan") if getattr(cfg, f) != defaults[f]]
    if dims.cp == 1:
        unused += [f for f in ("cp_mode",) if getattr(cfg, f) != defaults[f]]
    if dims.shard_size == 1:
        fsdp_fields = ("param_dtype", "reduce_dtype", "shard_modules", "reshard_after_forward")
        unused += [f for f in fsdp_fields if getattr(cfg, f) != defaults[f]]
    if unused:
        log.warning(
            "strategy.%s has no effect with %s.",
            ", strategy.".join(unused),
            dims.describe(),
        )


def checkpoint_format(cfg: Config, world: World) -> str:
    # under a pipeline each stage saves its own optimizer keys, so they are keyed per parameter
    return "dcp_flat" if dims_of(cfg, world.world_size).pp > 1 else "dcp"


def check_move(cfg: Config, source: str) -> None:
    """Any layout can be moved in: the full state is copied into the DTensor shards."""


def data_parallel(cfg: Config, world: World) -> tuple[int, int]:
    if cfg.fault_tolerance == "torchft":
        return replica_groups.data_parallel(cfg, world)
    return dims_of(cfg, world.world_size).data_parallel(world.rank)


def describe(cfg: Config, world: World | None) -> str:
    if world is not None:
        return dims_of(cfg, world.world_size).describe()
    degrees = [f"{k}={getattr(cfg, k)}" for k in DEGREES if getattr(cfg, k) != 1]
    return f"parallel({', '.join(degrees)})"


def mesh_dims(cfg: Config, world: World) -> ParallelDims:
    return dims_of(cfg, world.world_size)


def preflight_notes(cfg: Config, world: World) -> list[str]:
    if dims_of(cfg, world.world_size).pp > 1 and cfg.balance == "time":
        return ["balance=time cuts by measured time in the job; the check cuts by params."]
    return []


def saves_async(cfg: Config, world: World) -> bool:
    return True  # DCP's async_save (ParallelStrategy.save_async)


def data_traffic(cfg: Config, world: World, grads: int, params: int) -> float:
    """FSDP gathers the parameters again for backward: 3 x the shards times the data ranks;
    with torchft, an all-reduce of this process's gradient shards with its peers in the other
    groups besides."""
    n = dims_of(cfg, world.world_size).shard_size
    across = 2 * grads if cfg.fault_tolerance == "torchft" else 0
    return (3 * grads * n if n > 1 else 0) + across


def build(cfg: Config, world: World, inputs):
    if cfg.fault_tolerance == "torchft":
        from framework.strategies.parallel.ft import ReplicaGroupFSDP

        return ReplicaGroupFSDP(cfg, dims_of(cfg, world.world_size), world, inputs=inputs)
    from framework.strategies.parallel.strategy import ParallelStrategy

    return ParallelStrategy(cfg, dims_of(cfg, world.world_size), world, inputs=inputs)
