"""The Lightning strategies behind `strategy=ddp` (imports Lightning: loaded in workers only).

Both are `framework.strategy_base.Replicated`: the model transforms applied before Lightning
moves and wraps the task, and a checkpoint from another layout taken in.
"""

from __future__ import annotations

from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

from framework.strategy_base import Replicated


class PortableDDP(Replicated, DDPStrategy):
    pass


class PortableSingleDevice(Replicated, SingleDeviceStrategy):
    pass
