"""The Lightning strategies behind `strategy=ddp` (imports Lightning: loaded in workers only).

Both apply the model transforms before Lightning moves and wraps the task, and take in a
checkpoint from another layout: the model state goes in before setup (as Lightning loads a ddp
checkpoint), the optimizer state, keyed by parameter name, once the optimizer exists.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

from framework import portable
from framework.strategy_base import StrategyBase


class Replicated(StrategyBase):
    """ddp (and one process): every process holds the whole model and optimizer."""

    def setup(self, trainer) -> None:
        self.inputs.transforms.apply(self.lightning_module)  # type: ignore[attr-defined]
        super().setup(trainer)  # type: ignore[misc]

    def load_portable(self, state: portable.Portable) -> None:
        state.rest["state_dict"] = state.model
        # keyed by name until the optimizer exists
        state.rest["optimizer_states"] = state.optimizers

    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        if self.inputs.move_from is None:
            return super().load_optimizer_state_dict(checkpoint)  # type: ignore[misc]
        names = self.parameter_names()
        for optimizer, saved in zip(self.optimizers, checkpoint["optimizer_states"], strict=True):  # type: ignore[attr-defined]
            optimizer.load_state_dict(portable.indexed_state(optimizer, saved, names))


class PortableDDP(Replicated, DDPStrategy):
    pass


class PortableSingleDevice(Replicated, SingleDeviceStrategy):
    pass
