"""What a job's command (fit, validate, test, predict) needs of the task and its data, checked in
the `fw` process before anything is written or started.

Each evaluation command runs one of the task's step methods on one of the data module's
loaders, as Lightning's Trainer does: `fw validate` validation_step on val_dataloader, `fw test`
test_step on test_dataloader, `fw predict` predict_step on predict_dataloader. A command whose
step or loader is missing is refused (exit 2); the last line of `fw train` says how to test the
run, or which half of a test is missing (a test_step without test data, or the reverse), and
before launch it says once when there is validation data but no validation_step.
"""

from __future__ import annotations

import logging
from typing import Any

from framework.errors import ConfigError

log = logging.getLogger("framework.config")

# command -> (the task's step method, the data module's loader method)
HOOKS = {
    "validate": ("validation_step", "val_dataloader"),
    "test": ("test_step", "test_dataloader"),
    "predict": ("predict_step", "predict_dataloader"),
}


def defines(cls: type, base: type, name: str) -> bool:
    """Whether `cls` has its own `name`, not the Lightning base class's placeholder."""
    return getattr(cls, name, None) is not getattr(base, name, None)


def has_step(task_cls: type, command: str) -> bool:
    import lightning.pytorch as pl

    return defines(task_cls, pl.LightningModule, HOOKS[command][0])


def has_data(data_cls: type, command: str) -> bool:
    import lightning.pytorch as pl

    return defines(data_cls, pl.LightningDataModule, HOOKS[command][1])


def check_command(command: str, task: Any, task_cls: type, data_cls: type) -> None:
    """`fw validate|test|predict`: the task's step and its data module's loader both exist
    (`task`: the composed `task` node; its classes imported). A task's own predict_step is
    optional (Lightning's default calls the model on the batch)."""
    step, loader = HOOKS[command]
    if command != "predict" and not has_step(task_cls, command):
        raise ConfigError(
            "task._target_",
            task._target_,
            f"defines no {step}: fw {command} has nothing to run",
            hint=f"Add {step}(self, batch, batch_idx) to {task_cls.__name__}, logging its "
            f"metrics with self.log (e.g. '{prefix(command)}/loss').",
        )
    if not has_data(data_cls, command):
        raise ConfigError(
            "task.data._target_",
            task.data._target_,
            f"has no {loader}: fw {command} has no data to run on",
            hint=f"Add {loader}(self) to {data_cls.__name__}.",
        )


def prefix(command: str) -> str:
    """The metric prefix a task's step logs under by convention (`val/loss`, `test/loss`)."""
    return {"validate": "val"}.get(command, command)


def check_test_after_fit(task_cls: type, data_cls: type) -> None:
    """`trainer.test_after_fit`: the task has a test_step and its data module test data."""
    if not has_step(task_cls, "test"):
        problem = f"{task_cls.__name__} defines no test_step"
    elif not has_data(data_cls, "test"):
        problem = f"{data_cls.__name__} has no test_dataloader"
    else:
        return
    raise ConfigError("trainer.test_after_fit", True, f"there is no test to run: {problem}")


_NOTED: set[tuple[type, type]] = set()  # the pairs said of in this process (a sweep plans many)


def note_unvalidated(trainer: Any, task_cls: type, data_cls: type) -> None:
    """`fw train`, before launch: one line when the data module has validation data the task
    has no validation_step for (Lightning's own warning, from every worker, is silenced:
    framework/logs.py)."""
    if trainer.get("limit_val_batches") == 0 or (task_cls, data_cls) in _NOTED:
        return
    if has_data(data_cls, "validate") and not has_step(task_cls, "validate"):
        _NOTED.add((task_cls, data_cls))
        log.info(
            "%s has a val_dataloader but %s defines no validation_step: the run is not "
            "validated (trainer.limit_val_batches=0 says so without this line)",
            data_cls.__name__,
            task_cls.__name__,
        )


def after_fit(task: Any, data: Any, tested: bool) -> str:
    """What the last line of a run says of its test: how to run it, or which half is missing
    (a test_step without test data, or the reverse); '' when there is nothing to say."""
    step, loader = has_step(type(task), "test"), has_data(type(data), "test")
    name, data_name = type(task).__name__, type(data).__name__
    if step and loader:
        return "" if tested else "; test it with fw test RUN_DIR"
    if step:
        return f"; {name} defines test_step but {data_name} has no test_dataloader: untested"
    if loader:
        return f"; {data_name} has a test_dataloader but {name} defines no test_step: untested"
    return ""
