"""Lightning's DeepSpeedStrategy, made to run on the CPU too, and full states copied into ZeRO
partitions (imports DeepSpeed: workers only).

Lightning refuses DeepSpeed without CUDA. Three things differ on the CPU: the environment check,
the device-index validation (CPU devices have no index) and the `device_rank` DeepSpeed is given
(the local rank, where Lightning passes the CUDA index).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from datetime import timedelta
from pathlib import Path

import torch
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy

from framework.checkpoint.portable import (
    NotPortable,
    Read,
    TensorSpec,
    copy_value,
    flat_reads,
    group_of,
    model_key,
    state_key,
)
from framework.strategy_base import StrategyBase
from framework.world import collective_backend

log = logging.getLogger("framework.deepspeed")


class ZeroStrategy(StrategyBase, DeepSpeedStrategy):
    """DeepSpeed ZeRO on CUDA, or on the CPU with gloo."""

    strategy_name = "fw_deepspeed"

    def setup(self, trainer) -> None:
        task = self.lightning_module
        self.inputs.transforms.apply(task)  # before DeepSpeed wraps the model
        sources = pretrained_before_setup(self, task, trainer)
        super().setup(trainer)
        if self.optimizers:  # a Muon optimizer learns where its matrices lie in ZeRO's partitions
            from framework.strategies.deepspeed.muon import bind

            bind(self.deepspeed_engine.optimizer)
        from framework.checkpoint.load import measured

        reports = []
        for source in sources:  # ZeRO-3: each rank reads its partitions of pretrained weights
            with measured(source, None, self.global_rank, "pretrained") as figures:
                try:
                    filled = load_into_zero(self, source, with_state=False)
                finally:
                    source.close()
            reports.append(
                {
                    "directory": str(getattr(source, "directory", "")),
                    "local_bytes": filled,
                    "bytes_read": figures["read"],
                    "io_read": figures["io_read"],
                    "peak_rise": figures["peak_rise"],  # what the reading cost
                }
            )
        if reports:
            write_json(
                Path(trainer.default_root_dir) / "pretrained" / f"rank{self.global_rank}.json",
                reports,
            )

    def restore(self, source) -> None:
        from framework.checkpoint.load import measured

        try:
            with measured(source, *self.report_to(), "partitions") as figures:
                figures["held"] = load_into_zero(self, source)
        finally:
            source.close()

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

    def partition_first(self, model) -> None:
        """ZeRO-3: the model's parameters cut into this rank's partitions before DeepSpeed's
        engine sees the model (DeepSpeed's zero.Init over a built module, as its optimizer would
        do later), so the engine neither casts the whole model to low precision nor moves it
        whole to the device: a parameter is whole on the device only while it is cut, one at a
        time. The optimizer, built before, keeps the same parameter objects."""
        if not self.zero_stage_3:
            return
        import deepspeed

        deepspeed.zero.Init(
            module=model, remote_device=self.remote_device, config_dict_or_path=self.config
        )

    def _setup_model_and_optimizer(self, model, optimizer, lr_scheduler=None):
        self.partition_first(model)
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

    def _initialize_deepspeed_inference(self, model) -> None:
        """validate/test/predict (no optimizer): Lightning's engine for evaluation, given the
        local rank as `device_rank` on the CPU (Lightning passes the CUDA index, None there)."""
        self.partition_first(model)
        if not self.on_cpu:
            return super()._initialize_deepspeed_inference(model)
        import deepspeed

        initialize = deepspeed.initialize

        def with_local_rank(*args, **kwargs):
            kwargs["args"] = argparse.Namespace(device_rank=self.local_rank)
            return initialize(*args, **kwargs)

        deepspeed.initialize = with_local_rank  # for Lightning's one call, then put back
        try:
            super()._initialize_deepspeed_inference(model)
        finally:
            deepspeed.initialize = initialize


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


def pretrained_before_setup(strategy, task, trainer) -> list:
    """A model built on meta with pretrained weights to read (framework.nn.meta): under ZeRO-1/2
    each rank keeps the whole low-precision weights, read now, each tensor once; under ZeRO-3
    it keeps a partition of each: the parameters get storage they never touch (virtual memory:
    DeepSpeed copies out each rank's partition and frees the rest), and the partitions are read
    once the engine exists (the returned sources, named as the task names them)."""
    from framework.nn.meta import materialize, on_meta
    from framework.parallel.model import adapter_for

    if not on_meta(task):
        return []
    adapter = adapter_for(task)
    if not strategy.zero_stage_3:
        adapter.load_pretrained(
            task, torch.device("cpu"), trainer.default_root_dir, strategy.global_rank
        )
        return []
    sources = adapter.pretrained_sources(task)  # while the parameters have their whole shapes
    materialize(task, torch.device("cpu"))
    return sources


def write_json(path: Path, data) -> None:
    from framework import files

    path.parent.mkdir(parents=True, exist_ok=True)
    files.write_atomic(path, json.dumps(data, indent=1))


@torch.no_grad()
def load_into_zero(strategy, source, with_state: bool = True) -> int:
    """This rank's ZeRO partitions (stage 1, 2 or 3) of the model's fp32 weights, its optimizer
    state (`with_state`: a checkpoint; pretrained weights have none) and its low-precision
    weights, read from a checkpoint of any layout: each flat partition slice is read as the boxes
    of the whole tensor it covers (portable.flat_reads), straight into DeepSpeed's own buffers;
    the parameters the source does not hold are left as they are. Returns the bytes filled."""
    engine = strategy.deepspeed_engine
    ds_opt = engine.optimizer if strategy.optimizers else None
    names = strategy.parameter_names()
    model = engine.module
    stage3 = hasattr(ds_opt, "fp32_partitioned_groups_flat") or any(
        hasattr(p, "ds_tensor") for p in model.parameters()
    )
    saved = source.model()
    reads = [*buffer_reads(strategy, saved)]
    if ds_opt is None:  # validate / test / predict: the weights only
        for p in model.parameters():
            if names[id(p)] in saved:
                reads += partition_reads(p, names[id(p)], saved, stage3)
        source.read(reads)
        return filled(reads)
    spec = source.optimizers() if with_state else [None]
    if len(spec) != 1:
        raise NotPortable(f"the checkpoint holds {len(spec)} optimizers; DeepSpeed runs one")
    if stage3:
        reads += stage3_reads(ds_opt, names, saved, spec[0])
    else:
        reads += stage12_reads(ds_opt, names, saved, spec[0])
    source.read(reads)
    done = filled(reads)
    if stage3:  # the low-precision partitions from the fp32 ones just read
        for sub, lps in enumerate(ds_opt.fp16_groups):
            for p in (p for p in lps if names[id(p)] in saved):
                _, offset, count = ds_opt.grad_position[ds_opt.get_param_id(p)]
                part = ds_opt.fp32_partitioned_groups_flat[sub].narrow(0, offset, count)
                p.ds_tensor.data.zero_()
                p.ds_tensor.data.narrow(0, 0, count).copy_(part)
    return done


def filled(reads: list) -> int:
    return sum(r.out.numel() * r.out.element_size() for r in reads)


def buffer_reads(strategy, saved) -> list:
    """Reads of the model's buffers (every rank keeps them whole)."""
    from framework.checkpoint.load import reads_into

    reads = []
    for name, buffer in strategy.lightning_module.named_buffers():
        if name in saved:
            reads += reads_into(buffer, model_key(name))
    return reads


def partition_reads(p, name: str, saved, stage3: bool) -> list:
    """The parameter's low-precision part on this rank: its ZeRO-3 partition, else whole."""
    from framework.checkpoint.load import reads_into

    if not stage3 or p.data.numel() == saved[name].numel:  # whole (stage 1/2, persistent)
        return reads_into(p.data, model_key(name))
    import torch.distributed as dist

    part = p.ds_tensor.numel()
    start = dist.get_rank() * part
    count = max(0, min(part, saved[name].numel - start))
    return flat_reads(
        model_key(name), saved[name].shape, p.ds_tensor.data.narrow(0, 0, count), start
    )


def stage3_reads(ds_opt, names, saved, spec) -> list:
    """ZeRO-3: every parameter cut into `part` elements per rank; this rank's piece of its fp32
    weights and moments lies at `offset` in its sub-group's flat partition."""
    import torch.distributed as dist

    base = ds_opt.optimizer
    rank = dist.get_rank(group=ds_opt.dp_process_group)
    flats, lp_groups = ds_opt.fp32_partitioned_groups_flat, ds_opt.fp16_groups
    if spec is not None:
        set_groups(base, ds_opt.sub_group_to_group_id, flats, lp_groups, names, spec)
    reads = []
    for sub, lps in enumerate(lp_groups):
        flat = flats[sub]
        first = spec.state.get(names[id(lps[0])], {}) if lps and spec is not None else {}
        tensors = start_state(base.state[flat], flat, first)
        for p in lps:
            name = names[id(p)]
            if name not in saved:
                continue
            _, offset, count = ds_opt.grad_position[ds_opt.get_param_id(p)]
            start = rank * p.ds_tensor.numel()
            shape = saved[name].shape
            count = max(0, min(count, saved[name].numel - start))  # the padding stays zero
            reads += flat_reads(model_key(name), shape, flat.narrow(0, offset, count), start)
            if p.data.numel() == saved[name].numel:  # a persistent (never partitioned) parameter
                reads += partition_reads(p, name, saved, True)
            for key in tensors:
                view = base.state[flat][key].narrow(0, offset, count)
                reads += flat_reads(state_key(0, name, key), shape, view, start)
        reads += scalar_reads(base.state[flat], names[id(lps[0])] if lps else None, first)
    return reads


def stage12_reads(ds_opt, names, saved, spec) -> list:
    """ZeRO-1/2: every rank keeps the low-precision weights whole, and its fragment of each
    parameter's fp32 weights and moments (DeepSpeed's `_hp_mapping`: where in the parameter it
    starts, a view into the rank's flat partition)."""
    from framework.checkpoint.load import reads_into

    base = ds_opt.optimizer
    flats, lp_groups = ds_opt.single_partition_of_fp32_groups, ds_opt.bit16_groups
    set_groups(base, dict(enumerate(range(len(flats)))), flats, lp_groups, names, spec)
    reads, firsts = [], {}
    for flat, lps in zip(flats, lp_groups, strict=True):
        firsts[id(flat)] = spec.state.get(names[id(lps[0])], {}) if lps else {}
        start_state(base.state[flat], flat, firsts[id(flat)])
    ds_opt._hp_optimizer_states_linked = False
    ds_opt._lazy_init_hp_params_optimizer_state()
    for flat, lps in zip(flats, lp_groups, strict=True):
        for p in lps:
            name = names[id(p)]
            reads += reads_into(p.data, model_key(name))
            hp = getattr(p, "_hp_mapping", None)
            if hp is None:  # the parameter's fp32 copy lies wholly on other ranks
                continue
            start, shape = hp.lp_fragment_address.start, saved[name].shape
            reads += flat_reads(model_key(name), shape, hp.get_hp_fragment().view(-1), start)
            for key in hp.get_optim_state_keys():
                view = hp.get_optim_state_fragment(key).view(-1)
                reads += flat_reads(state_key(0, name, key), shape, view, start)
        reads += scalar_reads(
            base.state[flat], names[id(lps[0])] if lps else None, firsts[id(flat)]
        )
    return reads


def set_groups(base, owner, flats, lp_groups, names, spec) -> None:
    """Each param group's hyperparameters from the saved group holding its parameters."""
    lp_of = {id(flat): lps for flat, lps in zip(flats, lp_groups, strict=True)}
    for index, group in enumerate(base.param_groups):
        mine = [flats[s] for s in range(len(flats)) if owner[s] == index]
        group_names = [names[id(p)] for flat in mine for p in lp_of[id(flat)]]
        if group_names:
            group.update(group_of(spec.groups, group_names))


def start_state(slot: dict, flat, first: dict) -> list[str]:
    """The optimizer state of one flat partition made empty (it starts lazily, at the first
    step); returns the elementwise entries (read per parameter)."""
    tensors = []
    for key, value in first.items():
        if isinstance(value, TensorSpec) and value.shape:
            slot[key] = torch.zeros_like(flat)
            tensors.append(key)
        elif not isinstance(value, TensorSpec):
            slot[key] = copy_value(value)
    return tensors


def scalar_reads(slot: dict, name: str | None, first: dict) -> list:
    """Reads of a flat partition's scalar entries (Adam's step), from its first parameter's."""
    reads = []
    for key, value in first.items():
        if isinstance(value, TensorSpec) and not value.shape and name is not None:
            slot[key] = torch.zeros((), dtype=value.dtype)
            reads.append(Read(state_key(0, name, key), slot[key], ()))
    return reads
