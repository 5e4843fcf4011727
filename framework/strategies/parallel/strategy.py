"""The Lightning strategy behind every layout of `strategy=fsdp|tensor|fsdp_tp|pipeline` and the
explicit degrees (imports Lightning and torch.distributed: loaded in workers only).

Lightning's ModelParallelStrategy knows two mesh dimensions and asks the task to parallelize
itself in `configure_model`. This one builds the job's one mesh from its `ParallelDims` and calls
the one `parallelize`, so any task built from `framework.nn` blocks (or declaring plans) runs
unchanged. Under a pipeline it runs the step through `PipelineRunner` (schedule.py).
"""

from __future__ import annotations

import contextlib
import logging
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.strategies.strategy import Strategy
from lightning.pytorch.trainer.states import TrainerFn

from framework.parallel import context, pipeline
from framework.parallel.dims import ParallelDims
from framework.parallel.experts import expert_parameters, scale_expert_gradients
from framework.parallel.gradients import clip_by_total_norm, reduce_partial_gradients
from framework.parallel.model import adapter_for
from framework.parallel.parallelize import StageCut, parallelize
from framework.parallel.pipeline import stages
from framework.parallel.pipeline.schedule import PipelineRunner, pipeline_objective
from framework.parallel.pipeline.timeline import gathered_metrics, save_trace
from framework.parallel.placement import per_parameter_where_mixed, to_device
from framework.parallel.settings import parallel_settings
from framework.strategies.parallel import checkpoint_io
from framework.strategy_base import StrategyBase
from framework.world import collective_backend, host_group

log = logging.getLogger("framework.parallel")


class ParallelStrategy(StrategyBase, ModelParallelStrategy):
    strategy_name = "fw_parallel"

    def __init__(self, cfg, dims: ParallelDims, world, inputs) -> None:
        super().__init__(
            inputs=inputs,
            data_parallel_size=dims.data_size,
            tensor_parallel_size=dims.tp,
            save_distributed_checkpoint=True,
            process_group_backend=collective_backend(cfg.backend, world),
            timeout=timedelta(seconds=cfg.timeout_s),
        )
        self.cfg = cfg
        self.dims = dims
        self.pipeline: PipelineRunner | None = None
        self.context: context.ContextPlan | None = None  # cp > 1: attention across the cp ranks
        self.ties: stages.Ties | None = None
        self.async_saves = False  # within save_async only
        self.pending_save = None  # the Future of the background write save_async started
        self._save_group = None

    # ---- processes
    def setup_environment(self) -> None:
        Strategy.setup_environment(self)
        self._setup_distributed()
        self.mesh = self.dims.build_mesh(self.root_device.type)
        data = self.mesh["data"]
        if (data.get_local_rank(), data.size()) != tuple(self.inputs.data_parallel):
            raise RuntimeError(
                f"data-parallel coordinates {self.inputs.data_parallel} given, but the mesh "
                f"has ({data.get_local_rank()}, {data.size()})"
            )
        # Lightning reads this name (logging, the task's `device_mesh`)
        self._device_mesh = self.mesh.root
        self.lightning_module._device_mesh = self.mesh.root
        if self.dims.ep > 1:  # before the callbacks' setup, which looks for the MoE layers
            task = self.lightning_module
            adapter_for(task).swap_experts(task, self.dims.ep)

    def model_to_device(self) -> None:
        # Lightning's moves DTensors too (FSDP's CPU-offloaded shards): only what they left
        to_device(self.model, self.root_device)

    def data_group(self):
        # the ranks holding different tokens: under cp those of a group hold parts of sequences
        return self.mesh["tokens" if self.dims.cp > 1 else "data"].get_group()

    def before_optimizer_step(self) -> None:
        if self.dims.ep > 1:  # completes the expert gradients' division by the data ranks
            scale_expert_gradients(expert_parameters(self.lightning_module), self.dims.ep)
        super().before_optimizer_step()

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        data = self.mesh["data"]
        return {"num_replicas": data.size(), "rank": data.get_local_rank()}

    # ---- model
    def setup(self, trainer) -> None:
        self.accelerator.setup(trainer)
        task = self.lightning_module
        cut = self.cut_stages(task, trainer) if self.dims.pp > 1 else None
        tensor, fsdp = parallel_settings(task, self.cfg, self.dims, cut)
        modules = parallelize(
            task,
            self.mesh,
            self.dims,
            tensor,
            fsdp,
            self.inputs.transforms,
            cut,
            cp_mode=self.cfg.cp_mode,
        )
        self.context = context.plan_of(task)
        # a pretrained model built on meta: each rank reads the slices it now holds (before a
        # resumed checkpoint is restored over them)
        adapter_for(task).load_pretrained(
            task, self.root_device, trainer.default_root_dir, self.global_rank
        )
        to_device(task, self.root_device)
        finish_setup(self, trainer)
        if self.pipeline is not None:
            self.pipeline.start(modules, task)
        self.precision_plugin.clip_grad_by_norm = self.clip_grad_by_norm  # over every stage

    def cut_stages(self, task, trainer) -> StageCut:
        cfg = self.cfg
        owners = stages.stage_owners(cfg.schedule, self.dims.pp, cfg.virtual_stages)
        self.pipeline = runner = PipelineRunner(
            cfg.schedule, cfg.microbatches, owners, self.mesh, self.root_device
        )
        measure = None
        if cfg.balance == "time":
            measure = lambda chain: self.measured_costs(task, chain, trainer)  # noqa: E731
        cut = stages.cut(task, list(cfg.split_points), runner.n_stages, runner.mine, measure)
        if self.global_rank == 0:
            log.info(
                "Pipeline stages (first layers): %s",
                ", ".join(cut.chain[s].name for s in cut.starts),
            )
        self.ties = stages.Ties(task)
        self.ties.find_across(task, cut, runner.rank_of, self.mesh.root.mesh)
        if self.dims.data_size > 1:
            stages.check_no_local_ties(cut, task)
        task.pipeline_stages = list(runner.mine)
        return cut

    def measured_costs(self, task, chain, trainer) -> list[float]:
        """Seconds of forward + backward of each layer on one microbatch of the first training
        batch (median of 3; the whole model is still here, on the CPU: each layer is on the
        device only while it is timed, as the whole model may not fit one GPU). Rank 0's figures
        are used everywhere, so all processes cut the same stages; the random state, the CPU's
        and the GPU's (dropout in the timed layers), is left untouched."""
        batch = next(iter(trainer.datamodule.train_dataloader()))
        objective = pipeline_objective(task)
        x, y = objective.split(batch)
        rows = max(1, x.shape[0] // self.cfg.microbatches)
        device = self.root_device
        x, y = x[:rows].to(device), y[:rows].to(device)
        objective.begin(y, 1)
        gpus = [device.index or 0] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=gpus):
            costs = pipeline.time_layers(
                chain,
                x,
                lambda out: objective.loss(out, y),
                place=lambda layer: on_device(task, layer, device),
            )
        for p in task.parameters():
            p.grad = None
        shared = [costs]
        dist.broadcast_object_list(shared, src=0)
        return shared[0]

    # ---- the step
    def loss_context(self):
        """torch's loss_parallel: cross-entropy on vocabulary-split logits, forward and backward."""
        if self.dims.tp > 1 and self.cfg.loss_parallel and self.pipeline is None:
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()
        return contextlib.nullcontext()

    def sequence_chunks(self, args: tuple) -> tuple:
        """cp > 1: the step's batch cut to this rank's chunks of each sequence (the cp ranks
        of a group read the same batch)."""
        if self.context is None:
            return args
        return (self.context.split(args[0]), *args[1:])

    def training_step(self, *args, **kwargs):
        if self.pipeline is None:
            with self.loss_context(), context.running(self.context):
                args = self.sequence_chunks(args)
                return plain(super().training_step(*args, **kwargs))
        batch, batch_idx = self.sequence_chunks(args)[:2]
        task = self.lightning_module
        trainer = task.trainer
        trace = self.cfg.trace and trainer.global_step == self.cfg.trace_step
        stepping = not trainer.fit_loop.epoch_loop._should_accumulate()
        with context.running(self.context):  # the schedule runs forward and backward
            loss = self.pipeline.training_step(
                batch,
                batch_idx,
                self.precision_plugin.train_step_context,
                trace,
                self.ties if stepping else None,
            )
        if trace or trainer._logger_connector.should_update_logs:  # a gather: not every step
            self.log_pipeline(task, trace)
        task.log("train/loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, *args, **kwargs):
        return self.evaluation_step(super().validation_step, args, kwargs, "val/loss")

    def test_step(self, *args, **kwargs):
        return self.evaluation_step(super().test_step, args, kwargs, "test/loss")

    def evaluation_step(self, step, args: tuple, kwargs: dict, name: str):
        """The task's own step (`step`: Lightning's, which calls it), or under a pipeline, where
        no process holds the whole model, each stage on the whole batch in turn with the task's
        `loss` logged as `name`."""
        if self.pipeline is None:
            with self.loss_context(), context.running(self.context):
                return plain(step(*self.sequence_chunks(args), **kwargs))
        with context.running(self.context):
            batch = self.sequence_chunks(args)[0]
            loss = self.pipeline.validation_step(batch, self.precision_plugin.val_step_context)
        self.lightning_module.log(name, loss, prog_bar=True, sync_dist=True)
        return loss

    def backward(self, closure_loss, optimizer, *args, **kwargs):
        if self.pipeline is not None:
            self.pipeline.backward()
            return closure_loss
        # context.running: a checkpointed block's forward, run again here, attends as in the step
        with self.loss_context(), context.running(self.context):
            return super().backward(closure_loss, optimizer, *args, **kwargs)

    def reduce(self, tensor, *args, **kwargs):
        # values a task logs from a loss_parallel loss are replicated DTensors
        return super().reduce(plain(tensor), *args, **kwargs)

    def post_backward(self, closure_loss) -> None:
        super().post_backward(closure_loss)
        if self.cfg.sequence_parallel:  # the only source of partial gradients here
            reduce_partial_gradients(self.lightning_module.parameters())

    def clip_grad_by_norm(self, optimizer, clip_val) -> None:
        """Like torch's clip_grad_norm_, over the gradients of the whole model (every shard and
        stage; a weight tied across pipeline ranks counted once)."""
        params = [p for g in optimizer.param_groups for p in g["params"]]
        skip = set()
        if self.ties is not None:
            pp_rank = self.pipeline.pp_rank
            task = self.lightning_module
            skip = {
                id(p) for n, p in task.named_parameters() if self.ties.not_first_holder(n, pp_rank)
            }
        group = self.pipeline.group if self.pipeline is not None else None
        clip_by_total_norm(params, clip_val, self.root_device, skip, group)

    def log_pipeline(self, task, trace: bool) -> None:
        runner = self.pipeline
        metrics = gathered_metrics(
            runner.timeline, runner.n_stages, self.dims.pp, runner.group, self.root_device
        )
        for name, value in metrics.items():
            task.log(name, value)
        if trace:
            info = {
                "schedule": self.cfg.schedule,
                "pp": self.dims.pp,
                "microbatches": self.cfg.microbatches,
                "step": task.trainer.global_step,
            }
            run_dir = Path(task.trainer.default_root_dir)
            save_trace(
                runner.timeline, info, run_dir, runner.group, self.dims.pp, self.global_rank == 0
            )

    # ---- checkpoints
    def save_async(self, trainer, filepath):
        """DCP's async_save of the checkpoint (see StrategyBase.save_async)."""
        self.async_saves = True
        try:
            trainer.save_checkpoint(filepath, weights_only=False)
        finally:
            self.async_saves = False
        future, self.pending_save = self.pending_save, None
        return future

    def save_checkpoint(self, checkpoint, filepath, storage_options=None) -> None:
        """Lightning's DCP save, or with `async_saves` the same files written by a background
        thread: the state is copied first, so training may go on changing it."""
        if not self.async_saves:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        import torch.distributed.checkpoint as dcp

        path = Path(self.broadcast(filepath))
        path.mkdir(parents=True, exist_ok=True)
        state = {"state_dict": checkpoint.pop("state_dict")}
        for i, optimizer_state in enumerate(checkpoint.pop("optimizer_states", [])):
            state[f"optimizer_{i}"] = optimizer_state
        if self._save_group is None:  # its own group: the writer thread's collectives must not
            self._save_group = host_group("async-save")  # interleave with training's
        self.pending_save = dcp.async_save(
            state, checkpoint_id=path, process_group=self._save_group
        )
        if self.global_rank == 0:
            torch.save(checkpoint, path / "meta.pt")
        return None

    def optimizer_state(self, optimizer) -> dict[str, Any]:
        if self.pipeline is None:
            return super().optimizer_state(optimizer)
        return checkpoint_io.flat_optimizer_state(self.model, optimizer)

    def restore(self, source) -> None:
        checkpoint_io.restore(self, source)


@contextlib.contextmanager
def on_device(task, layer, device):
    """`layer`'s modules on `device` for the block's span, then back on the CPU."""
    modules = [task.get_submodule(name) for name in layer.modules]
    for module in modules:
        module.to(device)
    try:
        yield
    finally:
        for module in modules:
            module.to("cpu")


def finish_setup(strategy: ModelParallelStrategy, trainer) -> None:
    """After the model is made parallel in place: precision, optimizers (when fitting), devices."""
    strategy.model = strategy.precision_plugin.convert_module(strategy.model)
    strategy.barrier()
    fitting = trainer.state.fn == TrainerFn.FITTING
    if fitting:
        strategy.setup_optimizers(trainer)
        per_parameter_where_mixed(strategy.optimizers)
    strategy.setup_precision_plugin()
    if fitting:
        _optimizers_to_device(strategy.optimizers, strategy.root_device)


def plain(output):
    """A step's loss as a plain tensor (loss_parallel returns a replicated DTensor)."""
    if hasattr(output, "to_local"):
        return output.to_local()
    if isinstance(output, dict) and hasattr(output.get("loss"), "to_local"):
        return {**output, "loss": output["loss"].to_local()}
    return output
