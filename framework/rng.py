"""Capture and restore every random generator a training step can touch (per process)."""

from __future__ import annotations

import logging
import random
from typing import Any

import numpy as np
import torch

log = logging.getLogger("framework.rng")


def capture() -> dict[str, Any]:
    """This process's generator states, in types `torch.load(weights_only=True)` accepts."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "gauss": float(gauss),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        # this process's device only: a resume may see other GPUs, or fewer, or map ranks to
        # devices differently
        state["cuda"] = torch.cuda.get_rng_state(torch.cuda.current_device())
    return state


def restore(state: dict[str, Any]) -> None:
    """Put back what `capture` took."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state(
        (n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"])
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        restore_cuda(state["cuda"])


def restore_cuda(saved: torch.Tensor | list[torch.Tensor]) -> None:
    """Put this process's device's generator back. Older checkpoints hold a list, every GPU the
    saving process saw: the entry of this device's index is taken, if the list has one."""
    device = torch.cuda.current_device()
    if isinstance(saved, (list, tuple)):
        if device >= len(saved):
            log.warning(
                "The checkpoint holds CUDA generator states of %d devices, none for cuda:%d: "
                "its generator keeps the state the job's seed gave it.",
                len(saved),
                device,
            )
            return
        saved = saved[device]
    torch.cuda.set_rng_state(saved, device)
