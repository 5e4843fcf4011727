"""Any Lightning logger by class: `+logger.NAME._target_=lightning.pytorch.loggers.TensorBoardLogger`
(TensorBoard, MLflow, Comet, Neptune, CSV, W&B, or a class of your own), the same way a callback
is added by `_target_`.

The class is imported and its arguments checked against its signature in the `fw` process,
before anything is written (a misspelt class or argument is exit 2). Where the class takes them
and the entry does not set them, the run fills in `save_dir` (RUN_DIR/NAME: each logger's files
in the run directory) and `version` (the run's id, kept in run.json: a resumed or evaluated run
writes to the same place, as W&B's run id does). Lightning's loggers write on rank 0 only.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from framework.errors import ConfigError

FILLED = ("save_dir", "version")  # what the run gives a logger class that takes it


def arguments(node: DictConfig) -> dict[str, Any]:
    return {k: v for k, v in OmegaConf.to_container(node, resolve=True).items() if k != "_target_"}


def filled(cls: type, args: dict[str, Any], name: str, run_dir: Path, run_id: str) -> dict:
    """`args` with the run's directory and id for the parameters of `cls` they leave unset."""
    params = inspect.signature(cls).parameters
    defaults = {"save_dir": str(Path(run_dir) / name), "version": run_id}
    return {**{k: v for k, v in defaults.items() if k in params and k not in args}, **args}


def checked(key: str, node: DictConfig, cls: Any) -> dict[str, Any]:
    """Before launch: the class is a Lightning logger; returns the arguments it will get (those
    the run fills in count as given), for validation to check against its signature."""
    from lightning.pytorch.loggers import Logger

    if not (inspect.isclass(cls) and issubclass(cls, Logger)):
        raise ConfigError(
            f"{key}._target_",
            node._target_,
            "not a Lightning logger (a subclass of lightning.pytorch.loggers.Logger)",
        )
    return filled(cls, arguments(node), key.rsplit(".", 1)[-1], Path("."), "id")


def build_target(name: str, node: DictConfig, ctx: Any) -> Any:
    """The logger `node._target_` names, in every worker (Lightning's loggers write on rank 0)."""
    from hydra.utils import get_class

    cls = get_class(node._target_)
    return cls(**filled(cls, arguments(node), name, ctx.run_dir, ctx.run_id))
