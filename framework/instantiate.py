"""The user's classes a config names by `_target_`, built from their config nodes: the task,
its data module, a callback of the user's own.

Used by the workers and by the checks before launch (the dry build, `fw check`, `fw prepare`),
so every one of them builds the same objects from the same node.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf


def instantiate_args(node: DictConfig, **extra: Any) -> Any:
    """The class `node._target_` called with the node's other keys (and `extra`)."""
    from hydra.utils import get_class

    args = {k: v for k, v in OmegaConf.to_container(node, resolve=True).items() if k != "_target_"}
    return get_class(node._target_)(**args, **extra)


def build_task(task_cfg: DictConfig) -> Any:
    """The task `task._target_` built from `task.model`; a TaskModule also takes
    `task.optimizer` and `task.scheduler`."""
    from hydra.utils import get_class

    from framework.task import TaskModule

    cls = get_class(task_cfg._target_)
    task = cls(**OmegaConf.to_container(task_cfg.model, resolve=True))
    if isinstance(task, TaskModule):
        task.configure_from(
            OmegaConf.to_container(task_cfg.optimizer, resolve=True),
            OmegaConf.to_container(task_cfg.scheduler, resolve=True),
        )
    return task
