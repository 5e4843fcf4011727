"""Models built without weights: parameters on the meta device until a strategy has placed or
split the model, then storage for what each rank keeps (a pretrained load fills it)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside get their parameters on the meta device, their buffers (e.g. rotary
    frequencies, which no checkpoint holds) as usual. Under a fake tensor mode (`fw check`'s
    simulated ranks) nothing changes: fake tensors hold no memory, and the simulation runs the
    step on them as they are."""
    from torch._guards import detect_fake_mode

    if detect_fake_mode() is not None:
        yield
        return
    register = nn.Module.register_parameter

    def to_meta(module, name, param):
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = to_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def on_meta(module: nn.Module) -> bool:
    """Whether some parameter of `module` still has no storage (built under
    `parameters_on_meta`, not loaded yet)."""
    return any(p.is_meta for p in module.parameters())


def materialize(module: nn.Module, device: torch.device) -> None:
    """Uninitialized storage on `device` for every meta tensor of `module`; other tensors are
    left as they are. Through `_apply` (FSDP2 then re-registers its shards), swapping each
    parameter's contents in place: a weight tied to another (an LM head to its embedding) is
    one object in both modules and stays so (a new Parameter per module would untie them)."""
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        module._apply(lambda t: torch.empty_like(t, device=device) if t.is_meta else t)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
