"""The training and validation step under a pipeline (pp > 1).

Lightning's loop calls `training_step`, then `backward`, then the optimizer. Under a pipeline the
schedule runs forward and backward of all microbatches together, so `training_step` runs the
whole schedule (the task's loss on the last stage, scaled so the gradients are those of the
batch mean: its own `loss`, or a transformers causal LM's, see pipeline.objective) and `backward` only puts the gradients back (Lightning zeroes them in between).
When the optimizer is about to step (not while accumulating), a weight held by two pipeline
ranks gets the sum of both gradients; the data-parallel reduction is FSDP's, driven by torch's
pipeline stages. Validation runs each stage on the whole batch in turn.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from framework.parallel import pipeline
from framework.parallel.gradients import match_parameter_layout, sum_tied
from framework.parallel.pipeline.stages import Ties
from framework.parallel.pipeline.timeline import Timeline

SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "zero_bubble": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
}
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32]


class PipelineRunner:
    """Runs this rank's stages: the schedule for training, stage by stage for validation."""

    def __init__(self, schedule: str, microbatches: int, owners: list[list[int]], mesh, device):
        self.schedule_name = schedule
        self.microbatches = microbatches
        self.owners = owners
        self.rank_of = {s: r for r, stages in enumerate(owners) for s in stages}
        self.n_stages = sum(len(s) for s in owners)
        self.group = mesh["pp"].get_group()
        self.pp_rank = mesh["pp"].get_local_rank()
        self.mine = owners[self.pp_rank]
        self.device = device
        self.timeline = Timeline()
        self.held: dict = {}
        self.losses: list = []
        self.stages: dict[int, nn.Module] = {}

    def global_rank_of(self, pp_rank: int) -> int:
        return dist.get_global_rank(self.group, pp_rank)

    def start(self, stages: dict[int, nn.Module], task) -> None:
        """Build torch's pipeline stages and schedule around this rank's stage modules."""
        from torch.distributed import pipelining

        self.stages, self.task = stages, task
        self.objective = pipeline_objective(task)
        staged = []
        for s in self.mine:
            stage = pipelining.PipelineStage(
                stages[s], s, self.n_stages, self.device, group=self.group
            )
            self.timeline.watch(stage)
            uncounted(stage, stages[s])
            staged.append(stage)
        cls = getattr(pipelining, SCHEDULES[self.schedule_name])
        single = self.schedule_name in ("gpipe", "1f1b")
        self.schedule = cls(
            staged[0] if single else staged,
            n_microbatches=self.microbatches,
            loss_fn=self.loss_fn,
            scale_grads=False,
        )

    def loss_fn(self, output, target):
        loss = self.objective.loss(output, target)
        self.losses.append((loss.detach(), _rows(target)))
        accumulate = self.task.trainer.accumulate_grad_batches
        return loss / (self.microbatches * accumulate)

    def training_step(
        self, batch, batch_idx: int, step_context, trace: bool, sync: Ties | None
    ) -> torch.Tensor:
        """Run the schedule on one batch; with `sync` (the optimizer steps after this batch),
        also sum the tied weights' gradients. Returns the batch's mean loss."""
        task = self.task
        trainer = task.trainer
        x, y = self.objective.split(batch)
        args = (x,) if 0 in self.mine else ()
        target = y if self.n_stages - 1 in self.mine else None
        if target is not None:
            self.objective.begin(target, self.microbatches)
        self.losses = []
        if batch_idx % trainer.accumulate_grad_batches == 0:  # a new accumulation window
            for p in task.parameters():
                if p.grad is not None:
                    p.grad.zero_()  # the buffers are reused: no new allocation every step
        if trace:
            dist.barrier(group=self.group)
        self.timeline.begin()
        with step_context():
            self.schedule.step(*args, target=target, return_outputs=False)
        self.timeline.end()
        if sync is not None:
            self.sync_gradients(sync)
        # Lightning zeroes gradients between training_step and backward: keep them until then
        self.held = {p: p.grad for p in task.parameters()}
        for p in self.held:
            p.grad = None
        self.losses = self.losses[-self.microbatches :]  # the first step also infers shapes
        return self.shared_loss()

    def backward(self) -> None:
        """The schedule ran the backward pass in training_step; its gradients go back in place."""
        for p, grad in self.held.items():
            p.grad = grad
        self.held = {}

    def sync_gradients(self, ties: Ties) -> None:
        """Before the optimizer steps: gradients laid out as their parameters, and a weight
        held by several pipeline ranks given the sum of their gradients."""
        params = dict(self.task.named_parameters(remove_duplicate=False))
        match_parameter_layout(params.values())
        for tied in ties.across:
            if self.pp_rank in tied.ranks:
                sum_tied([next(params[n] for n in tied.names if n in params)], tied.group)

    def validation_step(self, batch, step_context) -> torch.Tensor:
        x, y = self.objective.split(batch)
        self.losses = []
        with step_context():
            out = self.forward_whole(x)
            if out is not None:
                self.objective.begin(y, 1)
                self.losses.append((self.objective.loss(out, y).detach(), _rows(y)))
        return self.shared_loss()

    def shared_loss(self) -> torch.Tensor:
        """The batch's mean loss (microbatches weighted by size), sent from the last stage to
        every pipeline rank."""
        loss = torch.zeros((), device=self.device)
        if self.losses:
            total = sum(v.float() * n for v, n in self.losses)
            loss = total / sum(n for _, n in self.losses)
        dist.broadcast(loss, self.global_rank_of(self.rank_of[self.n_stages - 1]), self.group)
        return loss

    def forward_whole(self, x):
        """The model's output for a whole batch, stage after stage (on the last stage's rank;
        None on the others)."""
        for s in range(self.n_stages):
            here = self.rank_of[s]
            if here != self.pp_rank:
                continue
            if s > 0 and self.rank_of[s - 1] != here:
                x = _recv(self.global_rank_of(self.rank_of[s - 1]), self.group, self.device)
            x = self.stages[s](x)
            if s < self.n_stages - 1 and self.rank_of[s + 1] != here:
                _send(x, self.global_rank_of(self.rank_of[s + 1]), self.group)
        return x if self.rank_of[self.n_stages - 1] == self.pp_rank else None


def uncounted(stage, module) -> None:
    """torch's stage infers shapes once with a real forward (and backward) on the first step:
    the mixture-of-experts routers of `module` do not count those tokens."""
    from framework.parallel.experts import moe_layers

    routers = [m.router for m in moe_layers(module)]
    for name in ("_prepare_forward_infra", "_prepare_backward_infra"):
        run = getattr(stage, name)

        def paused(*args, run=run, **kwargs):
            for router in routers:
                router.counting = False
            try:
                return run(*args, **kwargs)
            finally:
                for router in routers:
                    router.counting = True

        setattr(stage, name, paused)


def pipeline_objective(task) -> pipeline.Objective:
    """The task's loss and batch split under a pipeline (checked before launch to exist)."""
    found = pipeline.objective(task)
    if found is None:
        raise ValueError(f"{type(task).__name__} defines no loss(output, target)")
    return found


def inputs_and_targets(task, batch):
    """(first stage's input, loss target) of a batch: the task's `pipeline_batch(batch)`, a
    transformers causal LM's token batch, else an (x, y) pair."""
    return pipeline_objective(task).split(batch)


def _rows(target) -> int:
    return int(target.shape[0]) if hasattr(target, "shape") and target.dim() > 0 else 1


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
