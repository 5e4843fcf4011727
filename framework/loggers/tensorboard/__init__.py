"""`logger=[csv,tensorboard]`: TensorBoard event files in RUN_DIR/tensorboard/.

Lightning's TensorBoardLogger, writing on rank 0 to one folder per run (a resumed run adds its
events there; an evaluation's metrics land beside training's): `tensorboard --logdir RUN_DIR`.
It needs the `tensorboardX` package (`pip install 'framework[tensorboard]'`) or TensorBoard's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from framework.config.fields import doc
from framework.errors import ConfigError
from framework.loggers import installed


@dataclass
class Config:
    """TensorBoard event files in the run directory."""

    kind: str = doc("tensorboard", "Logger plugin.")
    folder: str = doc("tensorboard", "Folder inside the run directory.")
    log_graph: bool = doc(False, "Also record the model's graph.")


def validate(cfg: Config, world) -> None:
    if not any(installed(name) for name in ("tensorboard", "tensorboardX")):
        raise ConfigError(
            "logger.tensorboard",
            cfg.kind,
            "neither tensorboardX nor tensorboard is installed",
            hint="Install it with `pip install 'framework[tensorboard]'`.",
        )


def build(cfg: Config, ctx):
    from lightning.pytorch.loggers import TensorBoardLogger

    return TensorBoardLogger(
        save_dir=str(Path(ctx.run_dir)),
        name=cfg.folder,
        version="",  # one folder per run: a restart adds to it
        log_graph=cfg.log_graph,
        default_hp_metric=False,
    )
