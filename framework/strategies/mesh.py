"""`strategy=tensor`, `strategy=fsdp_tp`, or any degrees: data, sharded-data and tensor parallel on
one DeviceMesh.

The degrees `dp` (replicated data parallel), `fsdp` (sharded data parallel) and `tp` (tensor
parallel) multiply to the number of processes; one of them may be -1 ("the rest"). The processes
form one mesh of shape (dp, fsdp, tp), tensor parallel innermost (neighbouring ranks, the fastest
links). The transforms are applied in a fixed order: tensor-parallel plans on the `tp` dimension
(from every `framework.nn` block, or `tp_plan()` of custom modules, or `strategy.tp_plan`), then
FSDP2 over the data-parallel dimensions (`fully_shard`; hybrid, replicate x shard, when both dp and
fsdp are above 1). `ep` is a placeholder for expert parallel, which does not exist yet; pipeline
parallel is `strategy=pipeline`, whose mesh is (pp, dp, tp). Checkpoints are sharded (torch.distributed.checkpoint).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from framework.config.fields import doc
from framework.errors import ConfigError
from framework.world import World

CHECKPOINT_FORMAT = "dcp"


@dataclass
class Config:
    """Degrees of data (dp), sharded data (fsdp) and tensor (tp) parallelism on one mesh."""

    kind: str = doc("mesh", "Strategy plugin.")
    dp: int = doc(1, "Replicated data-parallel degree (-1: the processes left over).")
    fsdp: int = doc(1, "Sharded data-parallel degree, FSDP2 (-1: the processes left over).")
    tp: int = doc(1, "Tensor-parallel degree (-1: the processes left over).")
    pp: int = doc(1, "Pipeline parallel lives in strategy=pipeline (here: must be 1).")
    ep: int = doc(1, "Expert-parallel degree (not built yet: must be 1).")
    sequence_parallel: bool = doc(
        False, "Split norms and dropout over the sequence between blocks (tp > 1)."
    )
    loss_parallel: bool = doc(
        True,
        "Leave an LMHead's logits split over the vocabulary and compute the task's cross-entropy "
        "without gathering them (tp > 1).",
    )
    tp_plan: list[str] = doc(
        [],
        "Extra plan entries 'module:style' (names may use * wildcards); styles in "
        "framework.nn.plan.STYLES, e.g. colwise, rowwise.",
    )
    reshard_after_forward: bool = doc(True, "FSDP: free gathered parameters after forward.")
    backend: str | None = doc(None, "Collective backend (None: nccl on CUDA, gloo on CPU).")
    timeout_s: int = doc(1800, "Seconds a collective may wait before the job fails.")


def degrees(cfg: Any, world_size: int) -> dict[str, int]:
    """The resolved degrees {dp, fsdp, tp}; ConfigError when they do not fit the processes."""
    for key in ("pp", "ep"):
        if cfg[key] != 1:
            raise ConfigError(
                f"strategy.{key}",
                cfg[key],
                "pipeline parallelism is strategy=pipeline (with its own dp and tp degrees)"
                if key == "pp"
                else "expert parallelism does not exist yet",
                [1],
            )
    return fit_degrees({k: int(cfg[k]) for k in ("dp", "fsdp", "tp")}, world_size)


def fit_degrees(values: dict[str, int], world_size: int) -> dict[str, int]:
    """Degrees (one may be -1, "the rest") resolved to multiply to the process count."""
    rest = [k for k, v in values.items() if v == -1]
    for key, value in values.items():
        if value < 1 and value != -1:
            raise ConfigError(f"strategy.{key}", value, "must be at least 1, or -1 for the rest")
    if len(rest) > 1:
        raise ConfigError(
            f"strategy.{rest[1]}", -1, f"only one degree may be -1 (strategy.{rest[0]} is too)"
        )
    known = math.prod(v for v in values.values() if v != -1)
    if rest:
        if world_size % known:
            raise ConfigError(
                f"strategy.{rest[0]}",
                -1,
                f"the other degrees multiply to {known}, which does not divide the "
                f"{world_size} processes",
            )
        values[rest[0]] = world_size // known
    product = math.prod(values.values())
    if product != world_size:
        shown = " x ".join(f"{k}={v}" for k, v in values.items())
        raise ConfigError(
            "strategy",
            shown,
            f"the degrees multiply to {product}, but the job has {world_size} processes "
            "(trainer.devices x trainer.num_nodes)",
            hint=f"Make {' x '.join(values)} equal the process count, or set one degree to -1.",
        )
    return values


def validate(cfg: Config, world: World) -> None:
    from framework.nn.plan import STYLES  # here, not at import: framework.nn imports torch

    degrees(cfg, world.world_size)
    for entry in cfg.tp_plan:
        name, _, style = str(entry).rpartition(":")
        if not name:
            raise ConfigError(
                "strategy.tp_plan", entry, "an entry is 'module:style', e.g. 'net.0:colwise'"
            )
        if style not in STYLES:
            raise ConfigError("strategy.tp_plan", entry, f"'{style}' is not a known style", STYLES)


def validate_job(cfg: Config, job: Any, world: World) -> None:
    """Checks that need the rest of the config: the model's shapes, the trainer's transforms."""
    tp = degrees(cfg, world.world_size)["tp"]
    if tp == 1:
        return
    trainer = job.trainer
    if (
        cfg.sequence_parallel
        and trainer.compile
        and trainer.activation_checkpointing == "selective"
    ):
        raise ConfigError(
            "trainer.activation_checkpointing",
            "selective",
            "with trainer.compile=true and strategy.sequence_parallel=true it trains wrong "
            "gradients in the installed torch (measured: losses off by 1e-2 within 10 steps)",
            ["full", "none"],
            hint="Use full, or turn off compile or sequence_parallel.",
        )
    if cfg.tp_plan:
        check_plan_names(cfg, job.task)
    check_tensor_dims(job.task, tp, cfg.sequence_parallel)


def check_tensor_dims(task: Any, tp: int, sequence_parallel: bool) -> None:
    """The sizes the task says tensor parallelism splits (its `tensor_parallel_dims`) divide
    by `tp`."""
    from framework.config.validate import import_target

    dims = getattr(import_target("task._target_", task._target_), "tensor_parallel_dims", None)
    if dims is None:
        return
    for key, value in dims(dict(task.model), sequence_parallel=sequence_parallel).items():
        if value % tp:
            raise ConfigError(
                f"task.model.{key}",
                value,
                f"must be divisible by the tensor-parallel degree strategy.tp={tp}",
                hint=f"Choose a multiple of {tp}, or another strategy.tp.",
            )


def check_plan_names(cfg: Config, task_cfg: Any) -> None:
    """Every `strategy.tp_plan` entry names modules of the task (built on the meta device: no
    memory, no weights)."""
    import torch

    from framework.nn.plan import matches
    from framework.worker import build_task

    with torch.device("meta"):
        task = build_task(task_cfg)
    names = [n for n, _ in task.named_modules() if n]
    for entry in cfg.tp_plan:
        pattern = str(entry).rpartition(":")[0]
        if not any(matches(pattern, n) for n in names):
            raise ConfigError(
                "strategy.tp_plan",
                entry,
                f"'{pattern}' names no module of {type(task).__name__}",
                hint=f"Its modules include: {', '.join(names[:8])}.",
            )


def build(cfg: Config, world: World):
    from framework.strategies._mesh import MeshStrategy

    return MeshStrategy(cfg, degrees(cfg, world.world_size), world)
