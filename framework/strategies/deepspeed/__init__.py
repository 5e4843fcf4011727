"""`strategy=zero1|zero2|zero3` (and `*_offload`): ZeRO sharded data parallel through DeepSpeed.

Stage 1 shards the optimizer state over the processes, stage 2 also the gradients, stage 3 also
the parameters. The DeepSpeed config is generated from these typed fields; `deepspeed_config`
passes any other DeepSpeed key through. Settings whose DeepSpeed defaults would change the
numerics against plain torch are fixed here: gradient clipping comes from
`trainer.gradient_clip_val` (DeepSpeed's default is 1.0), and the task's own optimizer (with its
explicit weight decay) is used, also when the optimizer state is offloaded to the CPU. Runs on
CUDA (NCCL) and, for tests and laptops, on the CPU (gloo).
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any

from framework.config.fields import doc
from framework.config.schema import CollectiveSettings
from framework.errors import ConfigError
from framework.world import World, collective_backend

OFFLOAD = ("none", "cpu", "nvme")
log = logging.getLogger("framework.deepspeed")


@dataclass
class Config(CollectiveSettings):
    """ZeRO stages 1-3 with optional CPU/NVMe offload (DeepSpeed)."""

    kind: str = doc("deepspeed", "Strategy plugin.")
    stage: int = doc(2, "ZeRO stage: 1 optimizer state, 2 + gradients, 3 + parameters.", (1, 2, 3))
    offload_optimizer: str = doc("none", "Keep the optimizer state (and its step) here.", OFFLOAD)
    offload_params: str = doc(
        "none", "Keep the parameters here between uses (stage 3 only).", OFFLOAD
    )
    nvme_path: str = doc("/local_nvme", "Directory for NVMe offload (a fast local disk).")
    param_persistence_threshold: int = doc(
        100_000, "Stage 3: parameters with fewer elements stay whole on every process.", min=0
    )
    bucket_size: int = doc(200_000_000, "Elements per reduce-scatter / all-gather bucket.", min=1)
    deepspeed_config: dict[str, Any] = doc({}, "Extra DeepSpeed config keys, merged over ours.")
    ep: int = doc(1, "Expert-parallel degree: only 1 under ZeRO (use strategy=expert or fsdp).")


def plan_candidates(gpus: int, tp_limit: int) -> list[tuple[str, list[str]]]:
    """`fw plan` tries the three ZeRO stages (not their offloading presets)."""
    return [(s, [f"strategy={s}"]) for s in ("zero1", "zero2", "zero3")]


def validate(cfg: Config, world: World, job: Any) -> None:
    collective_backend(cfg.backend, world)
    if cfg.ep != 1:
        raise ConfigError(
            "strategy.ep",
            cfg.ep,
            "expert parallel is not offered on DeepSpeed ZeRO",
            [1],
            hint="Use strategy=expert, or strategy=fsdp strategy.ep=N (FSDP2 with expert parallel).",
        )
    if importlib.util.find_spec("deepspeed") is None:
        raise ConfigError(
            "strategy",
            f"zero{cfg.stage}",
            "DeepSpeed is not installed",
            hint="Install it with `pip install 'framework[deepspeed]'`, or use strategy=ddp.",
        )
    if cfg.offload_params != "none" and cfg.stage != 3:
        raise ConfigError(
            "strategy.offload_params",
            cfg.offload_params,
            f"parameter offload needs ZeRO stage 3, not {cfg.stage}",
            ["none"],
        )
    nvme = "nvme" in (cfg.offload_optimizer, cfg.offload_params)
    if nvme and not (os.path.isdir(cfg.nvme_path) and os.access(cfg.nvme_path, os.W_OK)):
        raise ConfigError(
            "strategy.nvme_path",
            cfg.nvme_path,
            "not a writable directory",
            hint="Point it at a directory on a fast local disk.",
        )
    if nvme and not async_io_available(world):
        key = "offload_optimizer" if cfg.offload_optimizer == "nvme" else "offload_params"
        raise ConfigError(
            f"strategy.{key}",
            "nvme",
            "NVMe offload needs DeepSpeed's async_io op, which cannot be built on this machine "
            "(the libaio library and headers were not found)",
            ["cpu", "none"],
            hint="Install libaio (e.g. apt install libaio-dev), or offload to the CPU.",
        )
    pipeline = int(cfg.deepspeed_config.get("pipeline", {}).get("stages", 1) or 1)
    if cfg.stage == 3 and pipeline > 1:
        raise ConfigError(
            "strategy.stage", cfg.stage, "ZeRO-3 cannot be combined with a pipeline", [1, 2]
        )


def checkpoint_format(cfg: Config, world: World) -> str:
    return "deepspeed"  # per-rank shards written by the DeepSpeed engine


def data_parallel(cfg: Config, world: World) -> tuple[int, int]:
    return world.rank, world.world_size


def describe(cfg: Config, world: World | None) -> str:
    return f"zero{cfg.stage}" if world is None else f"zero{cfg.stage} x {world.world_size}"


def model_states(cfg: Config, world: World, replica: Any, precision: str) -> tuple[Any, str]:
    """Each rank's share of the model states under this stage and offload (see memory.py)."""
    from framework.strategies.deepspeed.memory import zero_states

    return zero_states(replica, cfg, precision, world)


def data_traffic(cfg: Config, world: World, grads: int, params: int) -> float:
    """Stages 1-2: reduce-scatter the gradients, all-gather the updated parameters (2 x the
    whole parameters, as ddp's all-reduce); stage 3 gathers the parameters again for backward
    (3 x the shards times the ranks that share them)."""
    if cfg.stage < 3:
        return 2 * params
    n = world.world_size
    return 3 * grads * n if n > 1 else 0


def data_overlap(cfg: Config, world: World) -> float:
    """Only with `overlap_comm` (on under CUDA, `deepspeed_config`) does a reduction run beside
    the backward; without it each bucket's collective blocks the step. Stages 1-2 then
    reduce-scatter the gradients during backward, but all-gather the updated parameters after
    the optimizer step, with no compute left to hide behind: half of `data_traffic`. Stage 3
    prefetches its gathers and reduces during backward: all of it."""
    zero = deepspeed_config(cfg, world.is_cuda)["zero_optimization"]
    if not zero.get("overlap_comm"):
        return 0.0
    return 1.0 if cfg.stage == 3 else 0.5


def data_collectives(cfg: Config, world: World, grads: int, params: int) -> int | None:
    """Stages 1-2: a reduction per bucket of the gradients, two all-reduces of one value each
    before the optimizer step (the overflow check and the gradients' norm), and an all-gather
    per bucket of the updated parameters (as profiled on gloo; a parameter group beyond the
    first adds a gather, not counted here). Stage 3: one per 25 MiB, as the default."""
    if cfg.stage == 3:
        return None
    buckets = math.ceil(params / (4 * cfg.bucket_size))  # bucket_size counts fp32 elements
    return 2 * buckets + 2


def check_move(cfg: Config, source: str) -> None:
    """Refuse a checkpoint from another layout when state lives on NVMe: DeepSpeed swaps it to
    files that the conversion (framework/checkpoint/portable.py) does not fill."""
    if "nvme" in (cfg.offload_optimizer, cfg.offload_params):
        key = "offload_optimizer" if cfg.offload_optimizer == "nvme" else "offload_params"
        raise ConfigError(
            f"strategy.{key}",
            "nvme",
            f"{source}; state swapped to NVMe cannot be filled from another layout",
            ["cpu", "none"],
            hint="Resume with CPU offload once; its checkpoints then resume under NVMe offload.",
        )


def async_io_available(world: World) -> bool:
    """Whether DeepSpeed can build its async_io op (NVMe offload), checked without building it."""
    select_accelerator(world)
    import contextlib
    import io
    import logging

    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    from deepspeed.ops.op_builder import AsyncIOBuilder

    with contextlib.redirect_stdout(io.StringIO()):
        return bool(AsyncIOBuilder().is_compatible(verbose=False))


def select_accelerator(world: World, environ: MutableMapping[str, str] = os.environ) -> str:
    """Set DS_ACCELERATOR, which DeepSpeed reads once, at its first use, to this job's device.

    On the CPU `cpu` (unless set: it also silences DeepSpeed's detection warning). On CUDA an
    inherited `cpu` (the test suite's and the Makefile's CPU default, exported in a shell) would
    put the engine's module on the CPU while Lightning feeds CUDA batches: it becomes `cuda`.
    Any other value the user set is kept. Returns the value in effect."""
    if not world.is_cuda:
        return environ.setdefault("DS_ACCELERATOR", "cpu")
    if environ.get("DS_ACCELERATOR") == "cpu":
        log.info("DS_ACCELERATOR=cpu inherited by a CUDA job: DeepSpeed uses cuda instead.")
        environ["DS_ACCELERATOR"] = "cuda"
    return environ.get("DS_ACCELERATOR", "")


def deepspeed_config(cfg: Config, cuda: bool = False) -> dict[str, Any]:
    """The DeepSpeed JSON config generated from the typed fields (Lightning adds batch sizes).

    On CUDA the gradient reduction overlaps the backward and offloaded state sits in pinned
    (page-locked) host memory, DeepSpeed's advice for speed: copies to and from pinned memory
    run asynchronously at full PCIe bandwidth. On the CPU both are off: there is no separate
    stream to overlap with, nothing to pin for, and the CPU tests compare losses with ddp's."""
    zero: dict[str, Any] = {
        "stage": cfg.stage,
        "reduce_bucket_size": cfg.bucket_size,
        "allgather_bucket_size": cfg.bucket_size,
        "contiguous_gradients": True,
        "overlap_comm": cuda,
    }
    if cfg.stage == 3:
        zero["stage3_param_persistence_threshold"] = cfg.param_persistence_threshold
    for key, where in (
        ("offload_optimizer", cfg.offload_optimizer),
        ("offload_param", cfg.offload_params),
    ):
        if where != "none":
            zero[key] = {"device": where, "nvme_path": cfg.nvme_path, "pin_memory": cuda}
    config = {
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        # keep the task's optimizer (same numerics as ddp) also when its state is offloaded
        "zero_force_ds_cpu_optimizer": False,
        "wall_clock_breakdown": False,
    }
    return merge(config, dict(cfg.deepspeed_config))


def merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        out[key] = (
            merge(out[key], value)
            if isinstance(value, dict) and isinstance(out.get(key), dict)
            else value
        )
    return out


def build(cfg: Config, world: World, inputs):
    select_accelerator(world)  # before anything imports deepspeed in this process
    from framework.strategies.deepspeed.strategy import make_strategy

    return make_strategy(deepspeed_config(cfg, world.is_cuda), cfg, world, inputs)
