"""`lightning`: one Lightning checkpoint file holding the whole state (ddp, diloco, hogwild).

The file is opened once with its tensors on the meta device (framework/checkpoint/safe.py,
type-restricted); a box of a model tensor or an optimizer state is read from the file by position
(torchfile.py). Lightning keys the optimizer state by parameter position; the framework's
checkpoint callback records the parameter names beside it (`parameter_names`), which is what lets
another layout read it by name. What is not model or optimizer state (`rest`: loops, callbacks,
schedulers) is loaded whole: it is small.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from framework.checkpoint import safe
from framework.checkpoint.formats.torchfile import TorchFile, largest_piece, spec_of
from framework.checkpoint.portable import (
    MODEL,
    NAMES_KEY,
    NotPortable,
    OptimizerSpec,
    Read,
    TensorSpec,
)

TENSORS = ("state_dict", "optimizer_states", NAMES_KEY)


class LightningSource:
    """A Source (framework/checkpoint/portable.py) over one Lightning checkpoint file."""

    def __init__(self, path: Path, trusted: bool = False) -> None:
        self.path, self.trusted = path, trusted
        where = f"{path.parent.name}/{path.name}"
        self.tree = safe.load_torch(path, where, meta=True, trusted=trusted)
        if not isinstance(self.tree, dict) or "state_dict" not in self.tree:
            raise NotPortable(f"{where} is not a Lightning checkpoint (no state_dict)")
        self.file = TorchFile(path)
        self._optimizers: list[OptimizerSpec] | None = None
        self._by_index: list[dict[str, int]] = []

    def model(self) -> dict[str, TensorSpec]:
        return {
            name: spec_of(t)
            for name, t in self.tree["state_dict"].items()
            if isinstance(t, torch.Tensor)
        }

    def optimizers(self) -> list[OptimizerSpec]:
        if self._optimizers is None:
            self._optimizers = [self._optimizer(i) for i in range(len(self._states()))]
        return self._optimizers

    def _states(self) -> list[dict[str, Any]]:
        return self.tree.get("optimizer_states") or []

    def _optimizer(self, index: int) -> OptimizerSpec:
        names = self.tree.get(NAMES_KEY)
        if names is None:
            raise NotPortable(
                "it was written before checkpoints recorded their parameter names, so its "
                "optimizer state cannot be matched to the parameters of another layout"
            )
        saved = self._states()[index]
        by_position: dict[int, str] = {}
        groups = []
        for group, group_names in zip(saved["param_groups"], names[index], strict=True):
            by_position.update(zip(group["params"], group_names, strict=True))
            groups.append(
                {**{k: v for k, v in group.items() if k != "params"}, "params": group_names}
            )
        self._by_index.append({n: i for i, n in by_position.items()})
        state = {}
        for position, entries in saved["state"].items():
            state[by_position[position]] = {
                key: spec_of(v) if isinstance(v, torch.Tensor) else v for key, v in entries.items()
            }
        return OptimizerSpec(groups, state)

    def saved(self, key: tuple) -> torch.Tensor:
        if key[0] == MODEL:
            return self.tree["state_dict"][key[1]]
        _, index, name, entry = key
        self.optimizers()
        return self._states()[index]["state"][self._by_index[index][name]][entry]

    def read(self, requests: list[Read]) -> None:
        for request in requests:
            self.file.read_box(self.saved(request.key), request.offset, request.out)

    def rest(self) -> dict[str, Any]:
        """Everything but the model and optimizer tensors, loaded for real (mapped: only these
        entries' pages are read)."""
        where = f"{self.path.parent.name}/{self.path.name}"
        real = safe.load_torch(self.path, where, mmap=True, trusted=self.trusted)
        return {k: v for k, v in real.items() if k not in TENSORS}

    @property
    def bytes_read(self) -> int:
        return self.file.bytes_read

    def largest_read(self) -> int:
        return largest_piece(self.model(), self.optimizers() if NAMES_KEY in self.tree else [])

    def close(self) -> None:
        self.file.close()


class LightningFormat:
    """The Lightning checkpoint file: loads as written under any process count."""

    name = "lightning"
    any_world = True
    state = "state.ckpt"
    allowed: tuple[str, ...] = ()  # torch's weights_only types only

    def movable(self, meta: dict[str, Any]) -> str | None:
        if not meta.get("parameter_names", False):
            return (
                "it was written by ddp before checkpoints recorded parameter names, so its "
                "optimizer state cannot be moved to another strategy"
            )
        return None

    def open(self, path: Path, trusted: bool = False) -> LightningSource:
        return LightningSource(path, trusted)


FORMAT = LightningFormat()
