"""Where a task's tensors live after the parallel setup, and where the tensors handed to
collectives live.

Every rank builds the whole task on the CPU from the seed, then `parallelize` shards it.
`fully_shard` and `distribute_tensor` put their DTensors on the mesh's device; nothing else moves
by itself (torch's `PipelineStage` does not move its module either). `to_device` moves the rest,
as Lightning's own ModelParallelStrategy ends its setup with `model_to_device()`: norms and
embeddings outside the tensor-parallel plans, buffers, torchmetrics states, a pipeline's stage
layers, and every tensor of a layout whose degrees are all 1.

`misplaced` and `CollectiveDevices` are the checks `fw check` runs against a device that is not
the CPU (framework/preflight/devices.py), so a tensor left on the CPU, which only a GPU would
reject, is found on a machine without one.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

# the operator namespaces of torch.distributed's collectives (c10d: the process-group API,
# dist.all_reduce and friends; the others: the functional collectives DTensor uses)
COLLECTIVES = ("c10d", "_c10d_functional", "_c10d_functional_autograd", "c10d_functional")


def is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def on(t: torch.Tensor, device: torch.device) -> bool:
    """Whether `t` is on `device` (a device given without an index matches any index)."""
    here = t.device
    if here.type != device.type:
        return False
    return device.index is None or here.index is None or here.index == device.index


def metrics(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The torchmetrics metrics among `module`'s submodules, by name (none without torchmetrics)."""
    try:
        from torchmetrics import Metric
    except ImportError:
        return []
    return [(n, m) for n, m in module.named_modules() if isinstance(m, Metric)]


def metric_states(metric) -> list[tuple[str, torch.Tensor]]:
    """A metric's states (`add_state`): tensors, or lists of tensors, kept as attributes."""
    out = []
    for key in metric._defaults:
        value = getattr(metric, key)
        if torch.is_tensor(value):
            out.append((key, value))
        elif isinstance(value, (list, tuple)):
            out.extend((f"{key}.{i}", v) for i, v in enumerate(value) if torch.is_tensor(v))
    return out


@torch.no_grad()
def to_device(module: nn.Module, device: torch.device) -> None:
    """Move every parameter, buffer and torchmetrics state of `module` that is not a DTensor to
    `device`, in place. Parameter objects are kept (as `Module.to` keeps them), so tied weights
    and the references a pipeline's stages hold stay valid; DTensors stay where FSDP or tensor
    parallel put them (on the CPU on purpose under FSDP's CPU offload)."""
    device = torch.device(device)

    def move(t):
        return t if t is None or is_dtensor(t) or on(t, device) else t.to(device)

    for m in module.modules():
        for p in m._parameters.values():
            if p is not None and not is_dtensor(p) and not on(p, device):
                p.data = p.to(device)
        for key, b in m._buffers.items():
            m._buffers[key] = move(b)
    for _, metric in metrics(module):
        metric._apply(move)  # its states, its `_defaults` (reset() restores them) and `.device`


def misplaced(module: nn.Module, device: torch.device) -> list[tuple[str, torch.device]]:
    """(name, device) of each parameter, buffer and torchmetrics state of `module` that is not
    on `device` (a DTensor by its local shard)."""
    device = torch.device(device)
    found = [
        *module.named_parameters(),
        *module.named_buffers(),
        *(
            (f"{name}.{key}" if name else key, t)
            for name, metric in metrics(module)
            for key, t in metric_states(metric)
        ),
    ]
    return [(name, t.device) for name, t in found if not on(t, device)]


class CollectiveDevices(TorchDispatchMode):
    """While active, records every tensor handed to a collective (torch.distributed's or a
    functional one) that is not on `device`: `wrong` holds one line each, naming the collective
    and the framework line that called it."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = torch.device(device)
        self.wrong: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace in COLLECTIVES:
            leaves = torch.utils._pytree.tree_leaves((args, kwargs))
            for t in leaves:
                if torch.is_tensor(t) and not on(t, self.device):
                    name = func.overloadpacket.__name__.rstrip("_")
                    line = f"{name} of a {t.device} tensor {list(t.shape)}"
                    self.wrong.append(f"{line} ({caller()})")
                    break
        return func(*args, **kwargs)


PACKAGE = str(Path(__file__).resolve().parents[1])


def caller(*outside: str) -> str:
    """The innermost framework line on the stack outside this module (and the modules
    `outside`, by file), as `file:line`."""
    skipped = {__file__, *outside}
    frame = sys._getframe(1)
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith(PACKAGE) and path not in skipped:
            return f"{Path(path).resolve().relative_to(Path(PACKAGE).parent)}:{frame.f_lineno}"
        frame = frame.f_back
    return "outside the framework"


def per_parameter_where_mixed(optimizers) -> None:
    """A param group mixing DTensors with plain tensors (tensor parallel without FSDP leaves
    the norms plain) steps parameter by parameter: torch's foreach kernels, which optimizers
    left to choose (`foreach=None`) take on CUDA, refuse the mix. A group whose `foreach` the
    task set is left as it is."""
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            kinds = {is_dtensor(p) for p in group["params"]}
            if len(kinds) == 2 and "foreach" in group and group["foreach"] is None:
                group["foreach"] = False
