"""The dry build: what each worker will build, built once in the `fw` process before launch.

The task is instantiated on the meta device (no memory, no weights), the data module's
constructor runs (not its `setup`), and the optimizer and its LR schedule are built over the
task's meta parameters (for a plain LightningModule: its own `configure_optimizers`, where it
does not need the Trainer). An exception from any of them is a configuration error: it is
reported with the key it most likely came from (`task.optimizer.lr=-1: Invalid learning rate:
-1`), exit code 2, before anything is written. The built task is handed to the strategy's
checks, so the model is built once.
"""

from __future__ import annotations

import re
from typing import Any

from omegaconf import DictConfig, OmegaConf

from framework.errors import ConfigError
from framework.plugins import DataModuleHooks

NOT_ATTACHED = "is not attached to a `Trainer`"


def dry_build(task_cfg: DictConfig) -> tuple[Any, Any]:
    """The task built on the meta device and its data module (not set up), after the optimizer
    was built too; (None, None) for a task that builds on the CPU only."""
    import torch

    from framework.instantiate import build_task, instantiate_args
    from framework.task import TaskModule

    model_args = plain(task_cfg.model)
    try:
        with torch.device("meta"):
            task = build_task(task_cfg)
    except Exception as err:
        try:  # a build that only fails on the meta device (e.g. it reads a value) is not refused
            with torch.device("cpu"):
                build_task(task_cfg)
        except Exception:
            raise blame("task.model", model_args, err, task_cfg._target_) from None
        return None, None
    data_args = {k: v for k, v in plain(task_cfg.data).items() if k != "_target_"}
    try:
        data = instantiate_args(task_cfg.data)
    except Exception as err:
        raise blame("task.data", data_args, err, task_cfg.data._target_) from None
    if isinstance(data, DataModuleHooks):  # e.g. a prepared dataset that is not there
        data.check_ready("task.data")
    if isinstance(task, TaskModule):
        opt_args = {k: v for k, v in plain(task_cfg.optimizer).items() if k != "_target_"}
        try:
            optimizer = task.make_optimizer()
        except Exception as err:
            raise blame("task.optimizer", opt_args, err, task_cfg.optimizer._target_) from None
        try:
            task.make_scheduler(optimizer, lambda: 1000)
        except Exception as err:
            raise blame(
                "task.scheduler", plain(task_cfg.scheduler), err, "the LR schedule"
            ) from None
    else:
        try:
            task.configure_optimizers()
        except Exception as err:
            if NOT_ATTACHED not in str(err):  # it asks for the Trainer: checked in the workers
                raise blame(
                    "task.model", model_args, err, f"{type(task).__name__}.configure_optimizers"
                ) from None
    return task, data


def plain(node: Any) -> dict[str, Any]:
    return (
        OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)
    )


def blame(prefix: str, args: dict[str, Any], err: Exception, what: str) -> ConfigError:
    """A ConfigError for an exception raised while building `what` from `args`: the argument
    named in the message, else the one whose value appears in it, else the whole node."""
    message = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}".rstrip(
        ": "
    )
    text = str(err)
    # an argument named in the message (`betas` as "beta"), else one whose value appears in it
    named = [k for k in args if _named(str(k), text)]
    valued = [k for k, v in args.items() if any(_appears(x, text) for x in _scalars(v))]
    for found in (named, valued):
        if len(found) == 1:
            return ConfigError(f"{prefix}.{found[0]}", args[found[0]], f"{what} raised {message}")
    return ConfigError(prefix, args, f"{what} raised {message}")


def _scalars(value: Any) -> list[Any]:
    if isinstance(value, (list, tuple)):
        return [x for v in value for x in _scalars(v)]
    return [value] if isinstance(value, (int, float, str)) and not isinstance(value, bool) else []


def _appears(value: Any, text: str) -> bool:
    return bool(re.search(rf"(?<![\w.]){re.escape(str(value))}(?![\w.])", text))


def _named(name: str, text: str) -> bool:
    stem = name.rstrip("s")
    if re.search(rf"\b{re.escape(name)}\b", text):
        return True
    return len(stem) >= 4 and bool(re.search(rf"\b{re.escape(stem)}", text))
