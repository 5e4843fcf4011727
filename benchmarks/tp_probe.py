"""A callback the tensor-parallel benchmark injects into `fw train` from the command line.

On rank 0 it writes `tp-probe.json` to `out`: the bytes of the parameters this process holds
(local shards of DTensors), and, for training step `step`, every collective issued inside the
transformer blocks with its direction (forward or backward) and the number of elements of the
full tensor it moves (an all-reduce's input, an all-gather's output, a reduce-scatter's input).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.distributed.tensor.debug import CommDebugMode

COLLECTIVES = {"all_reduce": 0, "all_gather_into_tensor": 1, "reduce_scatter_tensor": 0}


class ElementCountingMode(CommDebugMode):
    """CommDebugMode that also adds up the elements each collective moves, per module."""

    def __init__(self) -> None:
        super().__init__()
        self.elements: dict[tuple[str, str, str], int] = defaultdict(int)
        self.calls: dict[tuple[str, str, str], int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        name = getattr(getattr(func, "_overloadpacket", None), "__name__", "")
        if out is not NotImplemented and name in COLLECTIVES:
            tensor = out if COLLECTIVES[name] else args[0]
            phase = "backward" if self.advanced_module_tracker.is_bw else "forward"
            key = (self.advanced_module_tracker.name, phase, name)
            self.elements[key] += tensor.numel()
            self.calls[key] += 1
        return out


def local_bytes(module: torch.nn.Module) -> int:
    total = 0
    for p in module.parameters():
        t = p.to_local() if hasattr(p, "to_local") else p
        total += t.numel() * t.element_size()
    return total


class TPProbe(pl.Callback):
    def __init__(self, out: str, step: int = 3, count: bool = True) -> None:
        self.out = Path(out)
        self.step = step
        self.count = (
            count  # off for DDP, whose wrapper CommDebugMode's module tracker cannot follow
        )
        self.mode: ElementCountingMode | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step and not self.count:
            if trainer.global_rank == 0:
                record = {"param_bytes_rank0": local_bytes(pl_module), "block_collectives": {}}
                (self.out / "tp-probe.json").write_text(json.dumps(record, indent=1))
        elif trainer.global_step == self.step:
            self.mode = ElementCountingMode()
            self.mode.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.mode is None:
            return
        mode, self.mode = self.mode, None
        mode.__exit__(None, None, None)
        if trainer.global_rank != 0:
            return
        blocks: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        for (module, phase, op), n in mode.elements.items():
            if ".blocks." in module:
                blocks[f"{phase}/{op}"]["elements"] += n
                blocks[f"{phase}/{op}"]["calls"] += mode.calls[(module, phase, op)]
        record = {
            "param_bytes_rank0": local_bytes(pl_module),
            "block_collectives": {k: dict(v) for k, v in blocks.items()},
        }
        (self.out / "tp-probe.json").write_text(json.dumps(record, indent=1))
