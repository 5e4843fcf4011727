"""The Lightning strategy behind `strategy=pipeline` (imports Lightning, torch.distributed).

Lightning's loop calls `training_step`, then `backward`, then the optimizer. Under a pipeline the
schedule runs forward and backward of all microbatches together, so `training_step` runs the
whole schedule (the task's `loss` on the last stage, scaled so the gradients are those of the
batch mean) and `backward` does nothing. When the optimizer is about to step (not while
accumulating), gradients are averaged over the data-parallel ranks and tied parameters that live
on two pipeline ranks (an embedding tied to the head) get the sum of both gradients. Clipping by
norm measures the norm over all stages. Validation runs each stage on the whole batch in turn.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.strategies.strategy import Strategy

from framework import portable
from framework.nn import pipeline
from framework.nn.plan import apply_tensor_parallel
from framework.strategies._fsdp import finish_setup, process_group_args
from framework.strategies._portable import PortableResume, load_into_fsdp
from framework.strategies.pipeline import stage_ranks
from framework.world import DP_RANK_ENV, DP_SIZE_ENV

NAMES = ("pp", "dp", "tp")
log = logging.getLogger("framework.pipeline")
SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "zero_bubble": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
}
FLAT = {"flatten_optimizer_state_dict": True}
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32]


class PipelineStrategy(PortableResume, ModelParallelStrategy):
    strategy_name = "fw_pipeline"
    checkpoint_format = "dcp_flat"

    def __init__(self, cfg, degrees: dict[str, int], world) -> None:
        super().__init__(
            data_parallel_size=degrees["dp"],
            tensor_parallel_size=degrees["tp"],
            **process_group_args(cfg, world),
        )
        self.cfg = cfg
        self.degrees = degrees
        self.model_transforms = None  # activation checkpointing and compile, set by the worker
        self.owner = stage_ranks(cfg.schedule, degrees["pp"], cfg.virtual_stages)
        self.n_stages = sum(len(s) for s in self.owner)
        self.rank_of = {s: r for r, stages in enumerate(self.owner) for s in stages}
        self.timeline = Timeline()
        self.held: dict = {}  # gradients between training_step and backward

    # ---- processes
    def setup_environment(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        Strategy.setup_environment(self)
        self._setup_distributed()
        shape = tuple(self.degrees[n] for n in NAMES)
        self.mesh = init_device_mesh(self.root_device.type, shape, mesh_dim_names=NAMES)
        self._device_mesh = self.mesh
        self._data_mesh = self.mesh["dp"]
        os.environ[DP_RANK_ENV] = str(self._data_mesh.get_local_rank())
        os.environ[DP_SIZE_ENV] = str(self._data_mesh.size())
        self.pp_group = self.mesh["pp"].get_group()
        self.pp_rank = self.mesh["pp"].get_local_rank()
        self.stage_ids = self.owner[self.pp_rank]

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self._data_mesh.size(), "rank": self._data_mesh.get_local_rank()}

    def global_rank_of(self, pp_rank: int) -> int:
        return dist.get_global_rank(self.pp_group, pp_rank)

    # ---- model
    def setup(self, trainer) -> None:
        self.accelerator.setup(trainer)
        task = self.lightning_module
        chain = pipeline.layers(task)
        if self.cfg.split_points:
            starts = pipeline.starts_at(chain, list(self.cfg.split_points))
        else:
            if self.cfg.balance == "time":
                costs = self.measured_costs(task, chain, trainer)
            else:
                costs = pipeline.costs(task, chain)
            starts = pipeline.balance(costs, self.n_stages)
        self.starts = starts
        if self.global_rank == 0:
            log.info("Pipeline stages (first layers): %s", ", ".join(chain[s].name for s in starts))
        # names of tied parameters, before the other stages' modules are dropped
        first: dict[int, str] = {}
        self.canonical = {
            name: first.setdefault(id(p), name)
            for name, p in task.named_parameters(remove_duplicate=False)
        }
        shared = pipeline.shared_parameters(task, chain, starts)
        self.tied = []  # (names, process group of the pipeline ranks holding it)
        for name, _, stages in shared:
            ranks = sorted({self.rank_of[s] for s in stages})
            if len(ranks) > 1:
                self.tied.append((self.aliases(name), ranks, self.group_across(ranks)))
        mine = [pipeline.stage_layers(chain, starts, s) for s in self.stage_ids]
        pipeline.keep_only(task, chain, [layer for part in mine for layer in part])
        task.pipeline_stages = list(self.stage_ids)
        if self.degrees["tp"] > 1:
            apply_tensor_parallel(
                task, self.mesh["tp"], {}, sequence_parallel=False, loss_parallel=False
            )
        if self.model_transforms is not None:
            self.model_transforms.apply(task)
        self.stages = {
            s: pipeline.Stage(task, part) for s, part in zip(self.stage_ids, mine, strict=True)
        }
        finish_setup(self, trainer)
        self.schedule = self.make_schedule()
        self.precision_plugin.clip_grad_by_norm = self.clip_grad_by_norm  # the norm of all stages

    def measured_costs(self, task, chain, trainer) -> list[float]:
        """Seconds of forward + backward of each layer on one microbatch of the first training
        batch (median of 3; the whole model is still here). Rank 0's figures are used
        everywhere, so all processes cut the same stages; the random state is left untouched."""
        batch = next(iter(trainer.datamodule.train_dataloader()))
        x, y = inputs_and_targets(task, batch)
        rows = max(1, x.shape[0] // self.cfg.microbatches)
        x, y = x[:rows].to(self.root_device), y[:rows].to(self.root_device)
        task.to(self.root_device)
        with torch.random.fork_rng(devices=[]):
            costs = pipeline.time_layers(chain, x, lambda out: task.loss(out, y))
        for p in task.parameters():
            p.grad = None
        shared = [costs]
        dist.broadcast_object_list(shared, src=0)
        return shared[0]

    def group_across(self, pp_ranks: list[int]):
        """A process group of these pipeline ranks (same dp and tp coordinates as this one);
        every process creates every such group, as torch requires."""
        grid = self.mesh.mesh  # global ranks, shape (pp, dp, tp)
        mine = None
        for d in range(grid.shape[1]):
            for t in range(grid.shape[2]):
                ranks = [int(grid[r, d, t]) for r in pp_ranks]
                group = dist.new_group(ranks)
                if dist.get_rank() in ranks:
                    mine = group
        return mine

    def aliases(self, name: str) -> list[str]:
        return [n for n, c in self.canonical.items() if c == name]

    def make_schedule(self):
        from torch.distributed import pipelining

        staged = []
        for s in self.stage_ids:
            stage = pipelining.PipelineStage(
                self.stages[s], s, self.n_stages, self.root_device, group=self.pp_group
            )
            self.timeline.watch(stage)
            staged.append(stage)
        cls = getattr(pipelining, SCHEDULES[self.cfg.schedule])
        single = self.cfg.schedule in ("gpipe", "1f1b")
        return cls(
            staged[0] if single else staged,
            n_microbatches=self.cfg.microbatches,
            loss_fn=self.loss_fn,
            scale_grads=False,
        )

    def loss_fn(self, output, target):
        loss = self.lightning_module.loss(output, target)
        self.losses.append((loss.detach(), _rows(target)))
        accumulate = self.lightning_module.trainer.accumulate_grad_batches
        return loss / (self.cfg.microbatches * accumulate)

    # ---- the step
    def training_step(self, batch, batch_idx):
        task = self.lightning_module
        trainer = task.trainer
        x, y = inputs_and_targets(task, batch)
        args = (x,) if 0 in self.stage_ids else ()
        target = y if self.n_stages - 1 in self.stage_ids else None
        self.losses = []
        if batch_idx % trainer.accumulate_grad_batches == 0:  # a new accumulation window
            for p in task.parameters():
                if p.grad is not None:
                    p.grad.zero_()  # the buffers are reused: no new allocation every step
        tracing = self.cfg.trace and trainer.global_step == self.cfg.trace_step
        if tracing:
            dist.barrier(group=self.pp_group)
        self.timeline.begin()
        with self.precision_plugin.train_step_context():
            self.schedule.step(*args, target=target, return_outputs=False)
        self.timeline.end()
        if not trainer.fit_loop.epoch_loop._should_accumulate():
            self.sync_gradients()
        # Lightning zeroes gradients between training_step and backward: keep them until then
        self.held = {p: p.grad for p in task.parameters()}
        for p in self.held:
            p.grad = None
        self.losses = self.losses[-self.cfg.microbatches :]  # the first step also infers shapes
        loss = self.shared_loss()
        if tracing or trainer._logger_connector.should_update_logs:  # a gather: not every step
            self.log_timeline(task, trace=tracing)
        task.log("train/loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def backward(self, closure_loss, optimizer, *args, **kwargs):
        # the schedule ran the backward pass in training_step; its gradients go back in place
        for p, grad in self.held.items():
            p.grad = grad
        self.held = {}
        return closure_loss

    def validation_step(self, batch, batch_idx):
        task = self.lightning_module
        x, y = inputs_and_targets(task, batch)
        self.losses = []
        with self.precision_plugin.val_step_context():
            out = self.forward_whole(x)
            if out is not None:
                self.losses.append((task.loss(out, y).detach(), _rows(y)))
        loss = self.shared_loss()
        task.log("val/loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def shared_loss(self) -> torch.Tensor:
        """The batch's mean loss (microbatches weighted by size), sent from the last stage to
        every pipeline rank."""
        loss = torch.zeros((), device=self.root_device)
        if self.losses:
            total = sum(v.float() * n for v, n in self.losses)
            loss = total / sum(n for _, n in self.losses)
        dist.broadcast(loss, self.global_rank_of(self.rank_of[self.n_stages - 1]), self.pp_group)
        return loss

    def forward_whole(self, x):
        """The model's output for a whole batch, stage after stage (on the last stage's rank;
        None on the others)."""
        for s in range(self.n_stages):
            here = self.rank_of[s]
            if here != self.pp_rank:
                continue
            if s > 0 and self.rank_of[s - 1] != here:
                x = _recv(self.global_rank_of(self.rank_of[s - 1]), self.pp_group, self.root_device)
            x = self.stages[s](x)
            if s < self.n_stages - 1 and self.rank_of[s + 1] != here:
                _send(x, self.global_rank_of(self.rank_of[s + 1]), self.pp_group)
        return x if self.rank_of[self.n_stages - 1] == self.pp_rank else None

    # ---- gradients
    def sync_gradients(self) -> None:
        """Tied parameters on several pipeline ranks get the sum of their gradients; all
        gradients are averaged over the data-parallel ranks."""
        params = dict(self.lightning_module.named_parameters(remove_duplicate=False))
        for p in params.values():  # a tensor-parallel gradient laid out as its parameter
            grad = p.grad
            if hasattr(grad, "placements") and grad.placements != p.placements:
                p.grad = grad.redistribute(p.device_mesh, p.placements)
        for names, ranks, group in self.tied:
            if self.pp_rank in ranks:
                p = next(params[n] for n in names if n in params)
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(_local(p.grad), group=group)
        if self.degrees["dp"] > 1:
            grads = [
                _local(p.grad) for p in self.lightning_module.parameters() if p.grad is not None
            ]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=self._data_mesh.get_group())
            flat /= self.degrees["dp"]
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()

    def clip_grad_by_norm(self, optimizer, clip_val) -> None:
        """Like torch's clip_grad_norm_, over the gradients of every stage (a tied parameter
        and a tensor-parallel replica counted once)."""
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        if not params:
            return
        skip = {
            id(p) for n, p in self.lightning_module.named_parameters() if self.not_first_holder(n)
        }
        total = torch.zeros((), device=self.root_device, dtype=torch.float64)
        tp = self.degrees["tp"]
        for p in params:
            if id(p) in skip:
                continue
            grad = p.grad
            sharded = hasattr(grad, "placements") and any(pl.is_shard() for pl in grad.placements)
            weight = 1.0 if sharded or tp == 1 else 1.0 / tp
            total += weight * _local(grad).double().pow(2).sum()
        dist.all_reduce(total)
        norm = (total / self.degrees["dp"]).sqrt()
        scale = torch.clamp(float(clip_val) / (norm + 1e-6), max=1.0)
        for p in params:
            _local(p.grad).mul_(scale.to(p.grad.dtype))

    def not_first_holder(self, name: str) -> bool:
        for names, ranks, _ in self.tied:
            if name in names:
                return self.pp_rank != ranks[0]
        return False

    # ---- observability
    def log_timeline(self, task, trace: bool) -> None:
        row = torch.zeros(self.n_stages + 2, dtype=torch.float64)
        for s, busy in self.timeline.busy().items():
            row[s] = busy
        row[-2] = self.timeline.peak
        row[-1] = self.timeline.wall()
        rows = [torch.zeros_like(row) for _ in range(self.degrees["pp"])]
        dist.all_gather(rows, row, group=self.pp_group)
        table = torch.stack(rows)
        busy = table[:, : self.n_stages].sum(0)
        wall = float(table[:, -1].max())
        p = self.degrees["pp"]
        bubble = 1.0 - float(busy.sum()) / (p * wall) if wall > 0 else 0.0
        task.log("pipeline/bubble", bubble)
        for s in range(self.n_stages):
            task.log(f"pipeline/busy_s_stage{s}", float(busy[s]))
        for r in range(p):
            task.log(f"pipeline/peak_microbatches_rank{r}", float(table[r, -2]))
        if trace:
            self.save_trace(task.trainer)

    def save_trace(self, trainer) -> None:
        events = [None] * self.degrees["pp"]
        dist.all_gather_object(events, self.timeline.relative(), group=self.pp_group)
        if not trainer.is_global_zero:
            return
        from framework.strategies._schedule_plot import draw

        run_dir = Path(trainer.default_root_dir)
        info = {
            "schedule": self.cfg.schedule,
            "pp": self.degrees["pp"],
            "microbatches": self.cfg.microbatches,
            "step": trainer.global_step,
            "events": events,
        }
        (run_dir / "pipeline_schedule.json").write_text(json.dumps(info))
        draw(info, run_dir / "pipeline_schedule.png")

    # ---- checkpoints
    def optimizer_state(self, optimizer) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
        )

        # keyed per parameter name: each stage saves its own keys, and any split reads them back
        options = StateDictOptions(cpu_offload=True, **FLAT)
        return get_optimizer_state_dict(self.model, optimizer, options=options)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict:
        if self.portable_from is not None:
            return super().load_checkpoint(checkpoint_path, weights_only)
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        path = Path(self.broadcast(checkpoint_path))
        options = StateDictOptions(**FLAT)
        state = {"state_dict": get_model_state_dict(self.model)}
        for i, opt in enumerate(self.optimizers):
            state[f"optimizer_{i}"] = get_optimizer_state_dict(self.model, opt, options=options)
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(self.model, state["state_dict"])
        for i, opt in enumerate(self.optimizers):
            set_optimizer_state_dict(self.model, opt, state[f"optimizer_{i}"], options=options)
        return torch.load(path / "meta.pt", map_location="cpu", weights_only=bool(weights_only))

    def load_portable(self, state: portable.Portable) -> None:
        """A full state (any layout) into this rank's stages; a tied parameter found under
        whichever of its names the checkpoint has."""
        own = set(self.lightning_module.state_dict())
        model = {}
        for name in own:
            found = next(
                (n for n in self.aliases(self.canonical.get(name, name)) if n in state.model), name
            )
            model[name] = state.model[found]
        optimizers = []
        for saved in state.optimizers:
            renamed = dict(saved["state"])
            groups = [dict(g) for g in saved["groups"]]
            for name in own:
                for alias in self.aliases(self.canonical.get(name, name)):
                    if alias in saved["state"] and name not in renamed:
                        renamed[name] = saved["state"][alias]
                        for g in groups:
                            if alias in g["params"]:
                                g["params"] = [*g["params"], name]
            optimizers.append({"state": renamed, "groups": groups})
        load_into_fsdp(self, portable.Portable(model, optimizers, state.rest))


class Timeline:
    """When each stage ran forward (F), backward (B; I and W when split) of which microbatch."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int, int, float, float]] = []
        self.start = self.stop = 0.0
        self.inflight = self.peak = 0

    def watch(self, stage) -> None:
        for kind, attr in (
            ("F", "forward_one_chunk"),
            ("B", "backward_one_chunk"),
            ("W", "backward_weight_one_chunk"),
        ):
            setattr(stage, attr, self._timed(stage, kind, getattr(stage, attr)))

    def _timed(self, stage, kind, run):
        def timed(chunk, *args, **kwargs):
            t0 = time.perf_counter()
            out = run(chunk, *args, **kwargs)
            t1 = time.perf_counter()
            label = kind
            if kind == "B" and not kwargs.get("full_backward", args[1] if len(args) > 1 else True):
                label = "I"
            self.events.append((label, stage.stage_index, int(chunk), t0, t1))
            self.inflight += 1 if label == "F" else -1 if label in ("B", "I") else 0
            self.peak = max(self.peak, self.inflight)
            return out

        return timed

    def begin(self) -> None:
        self.events, self.inflight, self.peak = [], 0, 0
        self.start = time.perf_counter()

    def end(self) -> None:
        self.stop = time.perf_counter()

    def wall(self) -> float:
        return self.stop - self.start

    def busy(self) -> dict[int, float]:
        out: dict[int, float] = {}
        for _, stage, _, t0, t1 in self.events:
            out[stage] = out.get(stage, 0.0) + t1 - t0
        return out

    def relative(self) -> list[tuple[str, int, int, float, float]]:
        return [(k, s, m, t0 - self.start, t1 - self.start) for k, s, m, t0, t1 in self.events]


def inputs_and_targets(task, batch):
    """The task's `pipeline_batch(batch)`; a LightningModule without one has (x, y) batches."""
    split = getattr(task, "pipeline_batch", None)
    if split is not None:
        return split(batch)
    x, y = batch
    return x, y


def _rows(target) -> int:
    return int(target.shape[0]) if hasattr(target, "shape") and target.dim() > 0 else 1


def _local(tensor):
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _send(x: torch.Tensor, dst: int, group) -> None:
    header = torch.zeros(8, dtype=torch.int64)
    header[0] = x.dim()
    header[1 : 1 + x.dim()] = torch.tensor(x.shape)
    header[7] = DTYPES.index(x.dtype)
    dist.send(header.to(x.device), dst, group=group)
    dist.send(x.contiguous(), dst, group=group)


def _recv(src: int, group, device) -> torch.Tensor:
    header = torch.zeros(8, dtype=torch.int64, device=device)
    dist.recv(header, src, group=group)
    shape = header[1 : 1 + int(header[0])].tolist()
    x = torch.empty(shape, dtype=DTYPES[int(header[7])], device=device)
    dist.recv(x, src, group=group)
    return x
