"""A callback that writes, per rank, the bytes of model state this process holds.

Added from the command line by `benchmarks/memory.py`:
`+callbacks.memory._target_=benchmarks.memory_probe.MemoryProbe +callbacks.memory.out=DIR`.
At the second optimizer step it reads the tensors themselves:

- gradients just before the optimizer step. DeepSpeed (stages 1 to 3) keeps this rank's reduced
  partition in the optimizer's `averaged_gradients`; any `p.grad` still allocated is counted as
  well (stage 1 keeps the full gradient there), with memory shared by several tensors counted once. Without
  DeepSpeed, `p.grad` (an FSDP DTensor's local shard);
- parameters after the step: a ZeRO-3 parameter's `ds_tensor`, an FSDP DTensor's local shard,
  otherwise the whole tensor;
- optimizer state after the step: the tensors in the torch optimizer's `state` (exp_avg,
  exp_avg_sq; the 0-dim step counters are left out). DeepSpeed wraps the torch optimizer, which
  only ever sees this rank's partition.

It also writes `grads_peak_in_backward`: the most bytes held in `p.grad` at once during that
step's backward pass (read after each gradient is accumulated, before DeepSpeed reduces and frees
it), and `master`: the bytes of the torch optimizer's own parameter tensors that are not
the model's parameters (DeepSpeed's fp32 partition copy), which the 16Ψ formula does not count.
"""

from __future__ import annotations

import json
import os

import lightning.pytorch as pl
import torch


def _local(t: torch.Tensor) -> torch.Tensor:
    """The part of a tensor held by this process (a DTensor's local shard)."""
    return t.to_local() if hasattr(t, "to_local") else t


def _bytes(tensors) -> tuple[int, int]:
    """(elements, bytes) of tensors, memory that several of them share counted once.

    Each tensor is taken as the address range [data_ptr, data_ptr + bytes) (all those read here
    are contiguous); the ranges are merged, so views of one buffer are not counted twice.
    """
    spans = sorted(
        (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), t.element_size())
        for t in tensors
        if t.numel() > 0
    )
    numel = nbytes = 0
    end = 0
    for start, stop, size in spans:
        start = max(start, end)
        if stop > start:
            nbytes += stop - start
            numel += (stop - start) // size
            end = stop
    return numel, nbytes


class MemoryProbe(pl.Callback):
    def __init__(self, out: str, step: int = 1) -> None:
        self.out = out
        self.step = step
        self.grads = (0, 0)
        self.peak = 0
        self.hooks: list = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step != self.step:
            return
        params = [p for p in pl_module.parameters() if p.requires_grad]

        def seen(_param) -> None:
            alive = [_local(p.grad) for p in params if p.grad is not None]
            self.peak = max(self.peak, _bytes(alive)[1])

        self.hooks = [p.register_post_accumulate_grad_hook(seen) for p in params]

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.global_step != self.step:
            return
        for hook in self.hooks:
            hook.remove()
        tensors = []
        averaged = getattr(optimizer, "averaged_gradients", None)
        if averaged:
            tensors += [t for ts in averaged.values() for t in ts if torch.is_tensor(t)]
        tensors += [_local(p.grad) for p in pl_module.parameters() if p.grad is not None]
        self.grads = _bytes(tensors)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step != self.step + 1:
            return
        params = list(pl_module.parameters())
        local = [p.ds_tensor if hasattr(p, "ds_tensor") else _local(p.data) for p in params]
        full = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in params)
        optimizer = trainer.optimizers[0]
        inner = getattr(optimizer, "optimizer", optimizer)
        state = [
            _local(t)
            for s in inner.state.values()
            for t in s.values()
            if torch.is_tensor(t) and t.dim() > 0
        ]
        model = {t.data_ptr() for t in local}
        master = [
            _local(p)
            for g in inner.param_groups
            for p in g["params"]
            if _local(p).data_ptr() not in model
        ]
        record = {
            "rank": trainer.global_rank,
            "world_size": trainer.world_size,
            "psi": full,
            "params": _bytes(local)[1],
            "grads": self.grads[1],
            "optimizer": _bytes(state)[1],
            "master": _bytes(master)[1],
            "grads_peak_in_backward": self.peak,
            "elements": {
                "params": _bytes(local)[0],
                "grads": self.grads[0],
                "optimizer": _bytes(state)[0],
                "master": _bytes(master)[0],
            },
        }
        path = os.path.join(self.out, f"memory-rank{trainer.global_rank}.json")
        with open(path, "w") as fh:
            json.dump(record, fh)
