"""Lightning's DeepSpeedStrategy, made to run on the CPU too (imports DeepSpeed: workers only).

Lightning refuses DeepSpeed without CUDA. Three things differ on the CPU: the environment check,
the device-index validation (CPU devices have no index) and the `device_rank` DeepSpeed is given
(the local rank, where Lightning passes the CUDA index).
"""

from __future__ import annotations

import argparse
import logging
import os
from datetime import timedelta
from pathlib import Path

from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy

from framework.strategies._portable import PortableResume, load_into_zero

log = logging.getLogger("framework.deepspeed")


class ZeroStrategy(PortableResume, DeepSpeedStrategy):
    """DeepSpeed ZeRO on CUDA, or on the CPU with gloo."""

    strategy_name = "fw_deepspeed"
    checkpoint_format = "deepspeed"  # a directory of per-rank shards (read by `fw export`)

    def load_portable(self, state) -> None:
        load_into_zero(self, state)

    @property
    def on_cpu(self) -> bool:
        return self.root_device.type == "cpu"

    def setup_environment(self) -> None:
        if not self.on_cpu:
            return super().setup_environment()
        DDPStrategy.setup_environment(self)  # Lightning's CUDA-only check skipped

    def setup_distributed(self) -> None:
        if not self.on_cpu:
            return super().setup_distributed()
        reset_seed()
        self.set_world_ranks()
        self._init_deepspeed_distributed()

    def _setup_model_and_optimizer(self, model, optimizer, lr_scheduler=None):
        if not self.on_cpu:
            return super()._setup_model_and_optimizer(model, optimizer, lr_scheduler)
        import deepspeed

        engine, ds_optimizer, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=self.local_rank),
            config=self.config,
            model=model,
            model_parameters=[p for p in model.parameters() if p.requires_grad],
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            dist_init_required=False,
        )
        return engine, ds_optimizer


def announce_first_build() -> None:
    """Say so before DeepSpeed spends a silent minute compiling its C++ ops the first time."""
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR", Path.home() / ".cache" / "torch_extensions"))
    built = any(root.glob("*/deepspeed_shm_comm*")) or any(root.glob("deepspeed_shm_comm*"))
    if not built and int(os.environ.get("RANK", "0")) == 0:
        log.info(
            "DeepSpeed compiles its C++ ops on first use (about a minute each); they are cached "
            "in %s for later runs.",
            root,
        )


def make_strategy(config: dict, cfg, world) -> ZeroStrategy:
    if not world.is_cuda:
        announce_first_build()
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    backend = cfg.backend or ("nccl" if world.is_cuda else "gloo")
    return ZeroStrategy(
        config=config,
        process_group_backend=backend,
        timeout=timedelta(seconds=cfg.timeout_s),
        logging_level=logging.WARNING,
    )
