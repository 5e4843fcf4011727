"""Lightning's DeepSpeedStrategy, made to run on the CPU too, and full states copied into ZeRO
partitions (imports DeepSpeed: workers only).

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

import torch
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy

from framework.checkpoint import portable
from framework.strategy_base import StrategyBase
from framework.world import collective_backend

log = logging.getLogger("framework.deepspeed")


class ZeroStrategy(StrategyBase, DeepSpeedStrategy):
    """DeepSpeed ZeRO on CUDA, or on the CPU with gloo."""

    strategy_name = "fw_deepspeed"

    def setup(self, trainer) -> None:
        self.inputs.transforms.apply(self.lightning_module)  # before DeepSpeed wraps the model
        super().setup(trainer)

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


def make_strategy(config: dict, cfg, world, inputs) -> ZeroStrategy:
    if not world.is_cuda:
        announce_first_build()
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    backend = collective_backend(cfg.backend, world)
    return ZeroStrategy(
        inputs=inputs,
        config=config,
        process_group_backend=backend,
        timeout=timedelta(seconds=cfg.timeout_s),
        logging_level=logging.WARNING,
    )


def load_into_zero(strategy, state: portable.Portable) -> None:
    """Copy full tensors into this rank's ZeRO partitions (stage 1, 2 or 3), padding skipped."""
    import torch.distributed as dist
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    ds_opt = strategy.deepspeed_engine.optimizer
    base = ds_opt.optimizer
    names = strategy.parameter_names()
    saved = state.optimizers[0]
    stage3 = hasattr(ds_opt, "fp32_partitioned_groups_flat")
    if stage3:
        flats, lp_groups = ds_opt.fp32_partitioned_groups_flat, ds_opt.fp16_groups
    else:
        flats, lp_groups = ds_opt.single_partition_of_fp32_groups, ds_opt.bit16_groups
    lp_of = {id(flat): lps for flat, lps in zip(flats, lp_groups, strict=True)}
    # Stage 3 puts its flat partitions (one per sub-group) into the param groups only during
    # the step; stages 1 and 2 have one flat partition per param group.
    owner = ds_opt.sub_group_to_group_id if stage3 else dict(enumerate(range(len(flats))))
    # The optimizer state starts lazily (first step): create it, then fill it.
    for index, group in enumerate(base.param_groups):
        mine = [flats[s] for s in range(len(flats)) if owner[s] == index]
        group_names = [names[id(p)] for flat in mine for p in lp_of[id(flat)]]
        group.update(portable.group_of(saved["groups"], group_names))
        for flat in mine:
            first = saved["state"].get(names[id(lp_of[id(flat)][0])], {})
            slot = base.state[flat]
            for key, value in first.items():
                elementwise = isinstance(value, torch.Tensor) and value.dim() > 0
                slot[key] = torch.zeros_like(flat) if elementwise else portable.copy_value(value)
    tensor_keys = [
        k
        for k, v in next(iter(saved["state"].values()), {}).items()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    ]
    if not stage3:
        ds_opt._hp_optimizer_states_linked = False
        ds_opt._lazy_init_hp_params_optimizer_state()
        for p in (p for lps in lp_groups for p in lps):
            name = names[id(p)]
            full = state.model[name].to(p.dtype)
            p.data.copy_(full)
            safe_set_full_fp32_param(p, state.model[name].float())
            for key in tensor_keys:
                safe_set_full_optimizer_state(p, saved["state"][name][key].float(), key)
        return
    rank = dist.get_rank(group=ds_opt.dp_process_group)
    for sub, lps in enumerate(lp_groups):
        flat = flats[sub]
        for p in lps:
            name = names[id(p)]
            _, offset, count = ds_opt.grad_position[ds_opt.get_param_id(p)]
            part = p.ds_tensor.numel()
            full = state.model[name]
            flat.data.narrow(0, offset, count).copy_(_partition(full.float(), part, rank)[:count])
            p.ds_tensor.data.copy_(_partition(full, part, rank).to(p.ds_tensor.dtype))
            if p.data.numel() == full.numel():  # a persistent (never partitioned) parameter
                p.data.copy_(full.view_as(p.data))
            for key in tensor_keys:
                value = _partition(saved["state"][name][key].float(), part, rank)[:count]
                base.state[flat][key].narrow(0, offset, count).copy_(value)


def _partition(value: torch.Tensor, part: int, rank: int) -> torch.Tensor:
    """This rank's ZeRO-3 partition of a full tensor (zero padding past its end)."""
    padded = torch.zeros(part * (rank + 1), dtype=value.dtype)
    n = min(value.numel(), padded.numel())
    padded[:n] = value.flatten()[:n]
    return padded.narrow(0, part * rank, part)
