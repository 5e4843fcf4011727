"""The outer loop of DiLoCo on one process: start-of-round parameters, the outer optimizer, the
position in the round, and the synchronisation itself. Plain torch (no Lightning).

A parameter's round ends when `steps - offset` is a multiple of H (`steps`: inner steps since the
rounds began, at the start of training or at a resume that could not continue a round); every
fragment has its own offset (0 without streaming). At its end the pseudo-gradient
`outer - current` is averaged over the processes in one all-reduce, handed to the outer optimizer
as the gradient of `outer`, and every process copies the stepped `outer` into its parameters.
Floating-point buffers are averaged with the first fragment, so replicas are equal after a full
synchronisation.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger("framework.diloco")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class Rounds:
    """One process's outer state: `outer` (the parameters as of each fragment's last sync), the
    outer optimizer over them, and `steps`."""

    def __init__(self, cfg: Any, module: torch.nn.Module, group: Any = None) -> None:
        self.sync_every = cfg.sync_every
        self.dtype = DTYPES[cfg.pseudo_grad_dtype]
        self.outer_cfg = cfg.outer_optimizer
        self.group = group
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.buffers = [b for b in module.buffers() if b.is_floating_point()]
        self.fragments = split(self.params, cfg.fragments)
        self.offsets = [f * cfg.sync_every // cfg.fragments for f in range(cfg.fragments)]
        self.steps = 0
        self.restart()

    def restart(self) -> None:
        """Start the rounds again from the current parameters, with a fresh outer optimizer."""
        self.outer = [p.detach().clone() for p in self.params]
        cfg = self.outer_cfg
        self.optimizer = torch.optim.SGD(
            self.outer, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov
        )
        self.steps = 0

    # ---- the round
    def after_inner_step(self) -> dict[str, float]:
        """Count one inner step; synchronise the fragments whose round ends here. Returns the
        metrics to log."""
        self.steps += 1
        due = [f for f, off in enumerate(self.offsets) if (self.steps - off) % self.sync_every == 0]
        metrics = {"comm/bytes_per_step": self.bytes_per_round() / self.sync_every}
        metrics["comm/ddp_bytes_per_step"] = self.ddp_bytes_per_step()
        indices = [i for f in due for i in self.fragments[f]]
        if indices:
            metrics["diloco/pseudo_grad_norm"] = self.sync(indices, with_buffers=0 in due)
        return metrics

    @torch.no_grad()
    def sync(self, indices: list[int], with_buffers: bool) -> float:
        """The outer step for the parameters `indices`; the norm of their averaged
        pseudo-gradient."""
        world = self.world_size()
        flat = torch.cat([(self.outer[i] - self.params[i]).reshape(-1) for i in indices])
        sent = flat.to(self.dtype)
        if world > 1:
            dist.all_reduce(sent, group=self.group)
        average = sent.to(flat.dtype) / world
        pieces = average.split([self.params[i].numel() for i in indices])
        for i, piece in zip(indices, pieces, strict=True):
            self.outer[i].grad = piece.view_as(self.outer[i])
        self.optimizer.step()  # parameters without a gradient (other fragments) stay as they are
        self.optimizer.zero_grad(set_to_none=True)
        for i in indices:
            self.params[i].copy_(self.outer[i])
        if with_buffers and self.buffers and world > 1:
            values = torch.cat([b.reshape(-1).float() for b in self.buffers])
            dist.all_reduce(values, group=self.group)
            means = (values / world).split([b.numel() for b in self.buffers])
            for b, v in zip(self.buffers, means, strict=True):
                b.copy_(v.view_as(b))
        return float(average.float().norm())

    def synced(self) -> bool:
        """Whether every fragment was just synchronised: all processes hold the same model."""
        return all((self.steps - off) % self.sync_every == 0 for off in self.offsets)

    def world_size(self) -> int:
        if not (dist.is_available() and dist.is_initialized()):
            return 1
        return dist.get_world_size(self.group)

    # ---- communication figures (bytes each process sends into the all-reduce)
    def bytes_per_round(self) -> int:
        size = torch.empty(0, dtype=self.dtype).element_size()
        return sum(p.numel() for p in self.params) * size + self.buffer_bytes()

    def ddp_bytes_per_step(self) -> int:
        """What ddp sends every step: each gradient, and (DDP's broadcast_buffers) the buffers."""
        return sum(p.numel() * p.element_size() for p in self.params) + self.buffer_bytes()

    def buffer_bytes(self) -> int:
        return sum(b.numel() * 4 for b in self.buffers)

    # ---- checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "optimizer": self.optimizer.state_dict(),
            "world_size": self.world_size(),
            "sync_every": self.sync_every,
            "fragments": len(self.fragments),
        }

    def outer_by_name(self) -> dict[str, torch.Tensor]:
        return dict(zip(self.names, (t.detach() for t in self.outer), strict=True))

    def with_outer(self, state: dict[str, Any]) -> dict[str, Any]:
        """A module state dict with each parameter's outer value in its place (under every name
        of a tied parameter)."""
        by_address = {
            p.data_ptr(): t.detach() for p, t in zip(self.params, self.outer, strict=True)
        }
        return {
            k: by_address.get(v.data_ptr(), v) if isinstance(v, torch.Tensor) and v.numel() else v
            for k, v in state.items()
        }

    def load_state_dict(self, state: dict[str, Any], outer: dict[str, torch.Tensor]) -> None:
        """Continue the saved rounds: `outer` are the start-of-round parameters by name."""
        with torch.no_grad():
            for name, t in zip(self.names, self.outer, strict=True):
                t.copy_(outer[name])
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps = int(state["steps"])


def split(params: list[torch.Tensor], count: int) -> list[list[int]]:
    """`count` runs of consecutive parameters with about equal numbers of elements."""
    total = sum(p.numel() for p in params)
    fragments: list[list[int]] = [[] for _ in range(count)]
    seen = 0
    for i, p in enumerate(params):
        f = min(count - 1, math.floor(seen * count / max(total, 1)))
        fragments[f].append(i)
        seen += p.numel()
    return fragments
