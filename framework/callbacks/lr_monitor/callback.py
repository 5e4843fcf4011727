"""The Lightning callback behind `callbacks.lr_monitor` (imports Lightning: loaded in workers)."""

from __future__ import annotations

from lightning.pytorch.callbacks import LearningRateMonitor

from framework.runtime.hooks import skip_unused


class LRMonitor(LearningRateMonitor):
    """Lightning's LearningRateMonitor, idle in a run with no logger (`logger=[]`), where
    Lightning's would stop the run: there is nowhere to log the rates to."""

    idle = False

    def on_train_start(self, trainer, *args, **kwargs) -> None:
        self.idle = not trainer.loggers
        if not self.idle:
            super().on_train_start(trainer, *args, **kwargs)
        skip_unused(self, idle=self.idle)

    def on_train_batch_start(self, trainer, *args, **kwargs) -> None:
        if not self.idle:
            super().on_train_batch_start(trainer, *args, **kwargs)

    def on_train_epoch_start(self, trainer, *args, **kwargs) -> None:
        if not self.idle:
            super().on_train_epoch_start(trainer, *args, **kwargs)
