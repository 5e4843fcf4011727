"""The device-placement check `fw check` runs for a CUDA target: after the parallel strategy's
setup, is every tensor of the task on the rank's GPU, and is every tensor handed to a collective
on the group's device? A tensor left on the CPU works on a CPU job and fails only on a GPU
("Expected all tensors to be on the same device", or NCCL's "No backend type associated with
device type cpu"), and no GPU runs our tests, so the check finds it here.

A CPU-only torch cannot make fake CUDA tensors take part in autograd or in most kernels, so the
GPU is stood in for by the `meta` device: like CUDA it is not the CPU, and fake tensors on it
refuse to mix with CPU ones. The rank runs the strategy's own setup path: the task built on the
CPU as the worker builds it, the job's mesh built for the device type (as the strategy builds it
for `cuda`), then the one `parallelize`, with `meta` as the rank's device. Then every parameter,
buffer and torchmetrics state must be on `meta`; then one step's forward and backward (the batch
moved to `meta`; context parallel's kernels and collectives, tensor parallel's, the loss's) and
the collectives the strategy issues around each step (the gradient norm for clipping, the
routers' token counts, a pipeline's loss and timing metrics) run under `CollectiveDevices`,
which records any tensor not on `meta` handed to a collective; an operation that mixes `meta`
with the CPU fails as it would on a GPU and is named.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from framework.errors import ConfigError
from framework.parallel.placement import CollectiveDevices, misplaced

TARGET = torch.device("meta")  # stands for the rank's GPU
# what torch says when one operation meets tensors of two devices (fake tensors, and real ones)
MIXED_DEVICES = ("found two different devices", "Expected all tensors to be on the same device")


def placement_errors(task_cfg, trainer_cfg, batch, rank: int, cfg, dims, transforms) -> list[str]:
    """What rank `rank` would leave off its GPU after setup, or hand to a collective on another
    device, one line each (none: the rank is placed right)."""
    from framework.parallel.parallelize import parallelize
    from framework.preflight.fakes import fake_batch, fake_mode, fake_world
    from framework.preflight.simulate import (
        _quiet_logging,
        before_parallelize,
        build_fake_task,
        settings,
    )

    mode = fake_mode()
    coords = dims.coordinates(rank)
    with fake_world(rank, dims.world_size), _quiet_logging(), meta_stands_for_cuda():
        task = build_fake_task(task_cfg, mode, trainer_cfg.precision)
        mesh = dims.build_mesh(TARGET.type)
        cut, _ = before_parallelize(task, cfg, dims, coords, fake_batch(mode, batch))
        tensor, fsdp = settings(task, cfg, dims, cut)
        parallelize(task, mesh, dims, tensor, fsdp, transforms, cut, TARGET, cfg.cp_mode)
        left = [f"{name} on {device}" for name, device in misplaced(task, TARGET)]
        if left:  # the collectives below would stop at the first device mismatch
            return left
        recorder = CollectiveDevices(TARGET)
        with mode, recorder:
            if cut is None:  # a pipeline's stages run under its schedule, not simulated here
                loss_parallel = tensor.loss_parallel and dims.tp > 1
                recorder.wrong += forward_backward(task, batch, loss_parallel, mode)
            step_collectives(task, mesh, cfg, dims)
    return recorder.wrong


def forward_backward(task, batch, loss_parallel: bool, mode) -> list[str]:
    """One training step's forward and backward on the rank's device (the collectives it issues
    are recorded by the caller's CollectiveDevices: context parallel's ring, all-gather and
    all-to-all, the loss's token count, tensor parallel's), with the batch moved there as
    Lightning moves it: an operation that meets a tensor left on the CPU fails here as on a GPU,
    named. A step whose shapes depend on its data (routed experts) cannot run on fake tensors:
    it is left out (the test suite records its all-to-all on real tensors)."""
    from torch.utils._pytree import tree_map

    from framework.parallel.context import plan_of
    from framework.preflight.fakes import data_dependent, fake_batch
    from framework.preflight.simulate import whole_step

    on_device = tree_map(
        lambda t: t.to(TARGET) if torch.is_tensor(t) else t, fake_batch(mode, batch)
    )
    try:
        whole_step(task, on_device, loss_parallel, plan_of(task))()
    except data_dependent():
        return []
    except RuntimeError as err:
        if not any(words in str(err) for words in MIXED_DEVICES):
            raise
        line = str(err).strip().splitlines()[0]
        return [f"the step's forward or backward mixes devices: {line} ({placement_caller(err)})"]
    return []


def placement_caller(err: BaseException) -> str:
    """The innermost framework line of the traceback of `err` outside the check itself, as
    `file:line`."""
    from pathlib import Path

    from framework.parallel.placement import PACKAGE

    found = "outside the framework"
    tb = err.__traceback__
    while tb is not None:
        path = tb.tb_frame.f_code.co_filename
        if path.startswith(PACKAGE) and not path.endswith(("devices.py", "placement.py")):
            found = f"{Path(path).relative_to(Path(PACKAGE).parent)}:{tb.tb_lineno}"
        tb = tb.tb_next
    return found


def step_collectives(task, mesh, cfg, dims) -> None:
    """The collectives the parallel strategy itself issues around a step, with the arguments it
    gives them: the gradient norm for clipping (over shards and pipeline stages), the routers'
    token counts over the data ranks, and under a pipeline the loss sent from the last stage and
    the gathered timing metrics."""
    from framework.parallel.experts import balance_routers
    from framework.parallel.gradients import clip_by_total_norm
    from framework.parallel.pipeline import stages
    from framework.parallel.pipeline.schedule import PipelineRunner
    from framework.parallel.pipeline.timeline import gathered_table

    params = [p for p in task.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    runner = None
    if dims.pp > 1:
        owners = stages.stage_owners(cfg.schedule, dims.pp, cfg.virtual_stages)
        runner = PipelineRunner(cfg.schedule, cfg.microbatches, owners, mesh, TARGET)
    clip_by_total_norm(params, 1.0, TARGET, set(), runner.group if runner else None)
    balance_routers(task, mesh["data"].get_group())
    if runner is not None:
        runner.shared_loss()
        gathered_table(runner.timeline, runner.n_stages, dims.pp, runner.group, TARGET)


def refuse(rank: int, layout: str, errors: list[str]) -> ConfigError:
    shown = "; ".join(errors[:6]) + (f"; and {len(errors) - 6} more" if len(errors) > 6 else "")
    return ConfigError(
        "strategy",
        layout,
        f"on a GPU, rank {rank} would hold tensors off its device after the strategy's setup or "
        f"hand them to a collective: {shown} (expected: the rank's GPU, cuda:<local rank>)",
        hint="This is a defect of the strategy or of the task (a tensor created without "
        "`device=`), not of the config; a CPU job runs, the first step on a GPU would fail.",
    )


@contextlib.contextmanager
def meta_stands_for_cuda():
    """What lets torch's FSDP2 take a `meta` mesh for a GPU one, for the block's span.

    FSDP2 asks the mesh's device module for the current device (`meta` has none) and, in the
    step, for its streams and events (the CPU's no-op ones stand in); it refuses to step
    parameters on `meta` (here the GPU, not parameters still to be made); it moves a tensor with
    `tensor.data = tensor.to(device)`, which a fake CPU tensor refuses for a `meta` one (their
    dispatch keys differ). A fake tensor's device is only its label, so a move between equal
    shapes relabels it. The fake process group has no backend for `meta` to batch point-to-point
    ops on: they are issued one by one, as on a backend that does not batch."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.distributed import device_mesh
    from torch.distributed.fsdp._fully_shard import (
        _fsdp_collectives,
        _fsdp_param_group,
        _fsdp_state,
        _fully_shard,
    )
    from torch.distributed.tensor import _random

    data = torch._C.TensorBase.data
    own_data = FakeTensor.__dict__.get("data")
    find_device = _fully_shard._get_device_from_mesh
    handle_of = device_mesh._get_device_handle
    # the modules that ask for a device's module (streams, events, device count) by this name
    handles = (device_mesh, _fsdp_collectives, _fsdp_param_group, _fsdp_state, _random)
    groups = _fsdp_param_group.FSDPParamGroup
    own_check = groups.__dict__["_validate_no_meta_params"]

    def set_data(self, value):
        moved = isinstance(value, FakeTensor) and value.fake_device != self.fake_device
        if moved and value.shape == self.shape and value.dtype == self.dtype:
            self.fake_device = value.fake_device
        else:
            data.__set__(self, value)

    FakeTensor.data = property(data.__get__, set_data)
    _fully_shard._get_device_from_mesh = lambda mesh: (
        TARGET if mesh.device_type == TARGET.type else find_device(mesh)
    )
    for module in handles:
        module._get_device_handle = lambda kind: (
            torch.cpu if kind == TARGET.type else handle_of(kind)
        )
    groups._validate_no_meta_params = lambda self: None  # meta is the GPU here, not "unmade"
    batch = dist.batch_isend_irecv
    dist.batch_isend_irecv = lambda ops: batch_on(ops, batch)
    try:
        yield
    finally:
        for module in handles:
            module._get_device_handle = handle_of
        groups._validate_no_meta_params = own_check
        dist.batch_isend_irecv = batch
        _fully_shard._get_device_from_mesh = find_device
        if own_data is None:
            del FakeTensor.data
        else:
            FakeTensor.data = own_data


def batch_on(ops, batch):
    """`dist.batch_isend_irecv(ops)` (`batch`), or for ops on `meta` each op issued on its own."""
    if not ops or ops[0].tensor.device != TARGET:
        return batch(ops)
    works = []
    for op in ops:
        peer = {"group_dst" if op.op is dist.isend else "group_src": op.group_peer}
        works.append(op.op(op.tensor, group=op.group, tag=op.tag, **peer))
    return [w for w in works if w is not None]
