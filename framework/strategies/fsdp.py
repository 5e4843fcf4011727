"""`strategy=fsdp`: fully sharded data parallel with PyTorch's FSDP2 (`fully_shard`).

Parameters, gradients and optimizer state are sharded over the processes; each sharding unit's
parameters are all-gathered just before its forward (and backward) and freed after it. The units
are chosen for the task: every block of an `nn.ModuleList` (a transformer's layers), then each
top-level child module of the task that holds parameters (which also takes embeddings and head);
`strategy.shard_modules` names module classes to use as units instead. Runs on CUDA (NCCL) and on
the CPU (gloo). Checkpoints are sharded (torch.distributed.checkpoint).
"""

from __future__ import annotations

from dataclasses import dataclass

from framework.config.fields import doc
from framework.errors import ConfigError
from framework.world import World

DTYPES = (None, "float32", "bfloat16", "float16")
CHECKPOINT_FORMAT = "dcp"  # torch.distributed.checkpoint shards


@dataclass
class Config:
    """FSDP2: parameters, gradients and optimizer state sharded over all processes."""

    kind: str = doc("fsdp", "Strategy plugin.")
    reshard_after_forward: bool = doc(True, "Free gathered parameters after forward (less memory).")
    param_dtype: str | None = doc(
        None, "Dtype of gathered parameters for compute (None: as stored).", DTYPES
    )
    reduce_dtype: str | None = doc(
        None, "Dtype gradients are reduced in (None: param_dtype).", DTYPES
    )
    cpu_offload: bool = doc(False, "Keep sharded parameters and optimizer state in CPU memory.")
    shard_modules: list[str] = doc([], "Class names of the sharding units (empty: automatic).")
    backend: str | None = doc(None, "Collective backend (None: nccl on CUDA, gloo on CPU).")
    timeout_s: int = doc(1800, "Seconds a collective may wait before the job fails.")


def validate(cfg: Config, world: World) -> None:
    if cfg.cpu_offload and not world.is_cuda:
        raise ConfigError(
            "strategy.cpu_offload",
            cfg.cpu_offload,
            "offloading to the CPU needs the job to run on CUDA",
            ["false"],
        )


def build(cfg: Config, world: World):
    from framework.strategies._fsdp import FSDP2Strategy

    return FSDP2Strategy(cfg, world)
