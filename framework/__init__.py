"""A declarative training framework for PyTorch in the Lightning style.

`import framework` is cheap: Lightning is imported when `TaskModule` is first used, and DeepSpeed
and W&B only when a config asks for them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from framework.errors import ConfigError

__version__ = "0.1.0"
__all__ = ["ConfigError", "TaskModule", "__version__"]

if TYPE_CHECKING:
    from framework.task import TaskModule


def __getattr__(name: str) -> Any:
    if name == "TaskModule":
        from framework.task import TaskModule

        return TaskModule
    raise AttributeError(f"module 'framework' has no attribute {name!r}")
