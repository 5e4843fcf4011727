"""`strategy=pipeline`: the model's layers cut into stages over processes (pipeline parallel),
composable with replicated data parallel (`dp`) and tensor parallel (`tp`) on one (pp, dp, tp)
DeviceMesh.

Each batch is split into `microbatches`; a schedule of torch.distributed.pipelining runs their
forward and backward passes over the stages:

- `gpipe`: all forwards, then all backwards (m microbatches' activations held per stage);
- `1f1b`: after a warm-up, one forward then one backward (at most p held per stage);
- `interleaved_1f1b`: `virtual_stages` stages per process, looped (a smaller bubble);
- `zero_bubble`: interleaved, the backward split into input- and weight-gradient parts that fill
  the bubble (torch's ScheduleInterleavedZeroBubble);
- `zbv`: zero bubble with two stages per process placed in a V (torch's ScheduleZBVZeroBubble).

Stages are balanced by parameter count or by measured time (`strategy.balance`), or cut at
`strategy.split_points`. The strategy runs the whole step (the schedule does forward and
backward); the task's
`loss(output, target)` is called on the last stage, and `train/loss`, `val/loss` are logged on
every process. Checkpoints are DCP directories whose optimizer state is keyed per parameter, so
they load into another split, another pp, or no pipeline at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from framework.config.fields import doc
from framework.errors import ConfigError
from framework.strategies.mesh import check_tensor_dims, fit_degrees
from framework.world import World

CHECKPOINT_FORMAT = "dcp_flat"
SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv"]
BALANCE = ["params", "time"]
LOOPED = ("interleaved_1f1b", "zero_bubble")  # several stages per process, placed round-robin


@dataclass
class Config:
    """Pipeline parallel: degrees pp x dp x tp, the schedule, its microbatches, the split."""

    kind: str = doc("pipeline", "Strategy plugin.")
    pp: int = doc(-1, "Pipeline-parallel degree (-1: the processes left over).")
    dp: int = doc(1, "Replicated data-parallel degree (-1: the processes left over).")
    tp: int = doc(1, "Tensor-parallel degree inside each stage (-1: the processes left over).")
    schedule: str = doc("1f1b", f"Pipeline schedule: {', '.join(SCHEDULES)}.")
    microbatches: int = doc(4, "Microbatches each batch is split into (must divide the batch).")
    virtual_stages: int = doc(
        1,
        "Stages per process: 1 for gpipe and 1f1b, 2 or more for the interleaved ones, 2 for zbv.",
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
    )
    trace: bool = doc(
        False, "Save a picture of the executed schedule (pipeline_schedule.png in the run dir)."
    )
    trace_step: int = doc(3, "The optimizer step whose schedule `trace` draws.")
    backend: str | None = doc(None, "Collective backend (None: nccl on CUDA, gloo on CPU).")
    timeout_s: int = doc(1800, "Seconds a collective may wait before the job fails.")


def degrees(cfg: Any, world_size: int) -> dict[str, int]:
    for key in ("pp", "dp", "tp"):
        if cfg[key] < 1 and cfg[key] != -1:
            raise ConfigError(f"strategy.{key}", cfg[key], "must be at least 1, or -1 for the rest")
    return fit_degrees({k: int(cfg[k]) for k in ("pp", "dp", "tp")}, world_size)


def stage_ranks(schedule: str, pp: int, virtual: int) -> list[list[int]]:
    """The stages each pipeline rank runs: round-robin, or a V for zbv (first and last stage on
    rank 0)."""
    if schedule == "zbv":
        return [[r, 2 * pp - 1 - r] for r in range(pp)]
    return [[r + k * pp for k in range(virtual)] for r in range(pp)]


def validate(cfg: Config, world: World) -> None:
    pp = degrees(cfg, world.world_size)["pp"]
    if cfg.balance not in BALANCE:
        raise ConfigError("strategy.balance", cfg.balance, "not a way to balance stages", BALANCE)
    if cfg.schedule not in SCHEDULES:
        raise ConfigError("strategy.schedule", cfg.schedule, "not a known schedule", SCHEDULES)
    v = cfg.virtual_stages
    needs, fits = {
        "gpipe": ("== 1", v == 1),
        "1f1b": ("== 1", v == 1),
        "zbv": ("== 2", v == 2),
    }.get(cfg.schedule, (">= 2", v >= 2))
    if not fits:
        raise ConfigError(
            "strategy.virtual_stages",
            v,
            f"schedule {cfg.schedule} needs virtual_stages {needs} (stages per process)",
            hint="gpipe and 1f1b run one stage per process; interleaved_1f1b and zero_bubble "
            "two or more; zbv exactly two.",
        )
    m = cfg.microbatches
    if m < 1:
        raise ConfigError("strategy.microbatches", m, "must be at least 1")
    if cfg.schedule != "gpipe" and m < pp:
        raise ConfigError(
            "strategy.microbatches",
            m,
            f"schedule {cfg.schedule} needs at least as many microbatches as pipeline ranks "
            f"(pp={pp})",
        )
    rounds = max(1, m // pp)
    if cfg.schedule in LOOPED and m % rounds:
        raise ConfigError(
            "strategy.microbatches",
            m,
            f"schedule {cfg.schedule} needs a multiple of pp={pp} microbatches (or fewer than "
            f"{2 * pp})",
        )
    if cfg.trace and cfg.trace_step < 1:
        raise ConfigError("strategy.trace_step", cfg.trace_step, "must be at least 1")


def validate_job(cfg: Config, job: Any, world: World) -> None:
    """Checks that need the task: its layers against the stages, the batch against the
    microbatches, the loss, the picture's plotting library."""
    import importlib.util

    found = degrees(cfg, world.world_size)
    n_stages = found["pp"] * cfg.virtual_stages
    if (
        cfg.schedule in ("zero_bubble", "zbv")
        and job.trainer.activation_checkpointing == "selective"
    ):
        raise ConfigError(
            "trainer.activation_checkpointing",
            "selective",
            f"schedule {cfg.schedule} runs each backward in two passes (input, then weight "
            "gradients), and torch's selective checkpointing allows only one",
            ["full", "none"],
            hint="Use full, or another schedule.",
        )
    batch = job.task.get("data", {}).get("batch_size")
    if isinstance(batch, int) and batch % cfg.microbatches:
        raise ConfigError(
            "strategy.microbatches",
            cfg.microbatches,
            f"must divide the batch of each data-parallel rank, task.data.batch_size={batch}",
            [d for d in range(1, batch + 1) if batch % d == 0][:12],
        )
    if cfg.trace and importlib.util.find_spec("matplotlib") is None:
        raise ConfigError(
            "strategy.trace",
            True,
            "drawing the schedule needs matplotlib, which is not installed",
            hint="pip install matplotlib (the project's `bench` extra), or leave trace off.",
        )
    check_layers(cfg, job.task, n_stages)
    if found["tp"] > 1:
        check_tensor_dims(job.task, found["tp"], sequence_parallel=False)


def check_layers(cfg: Config, task_cfg: Any, n_stages: int) -> None:
    """Build the task on the meta device (no memory, no weights) and cut it as the workers will."""
    import torch

    from framework.nn import pipeline
    from framework.task import TaskModule
    from framework.worker import build_task

    with torch.device("meta"):
        task = build_task(task_cfg)
    name = type(task).__name__
    if not hasattr(task, "loss") or type(task).loss is TaskModule.loss:
        raise ConfigError(
            "task._target_",
            task_cfg._target_,
            f"{name} defines no loss(output, target): pipeline parallel computes the loss on "
            "the last stage with it",
            hint="Add a loss method (and pipeline_batch, if a batch is not (input, target)).",
        )
    try:
        chain = pipeline.layers(task)
        pipeline.check_covered(task, chain)
    except ValueError as err:
        raise ConfigError("strategy", "pipeline", str(err)) from None
    if n_stages > len(chain):
        raise ConfigError(
            "strategy.pp",
            cfg.pp,
            f"{n_stages} stages (pp x virtual_stages) is more than the {len(chain)} layers of "
            f"{name} ({', '.join(layer.name for layer in chain[:6])}, ...)",
            hint="Use fewer stages, or a model with more layers.",
        )
    if not cfg.split_points:
        return
    if len(cfg.split_points) != n_stages - 1:
        raise ConfigError(
            "strategy.split_points",
            list(cfg.split_points),
            f"{n_stages} stages need {n_stages - 1} split points (where stages 2, 3, ... begin)",
        )
    try:
        pipeline.starts_at(chain, list(cfg.split_points))
    except KeyError as err:
        raise ConfigError(
            "strategy.split_points",
            err.args[0],
            f"is not where a layer of {name} begins",
            [layer.name for layer in chain][:16],
        ) from None
    except ValueError as err:
        raise ConfigError("strategy.split_points", list(cfg.split_points), str(err)) from None


def build(cfg: Config, world: World):
    from framework.strategies._pipeline import PipelineStrategy

    return PipelineStrategy(cfg, degrees(cfg, world.world_size), world)
