"""Any Lightning logger by class: `+logger.NAME._target_=lightning.pytorch.loggers.TensorBoardLogger`
(TensorBoard, MLflow, Comet, Neptune, CSV, W&B, or a class of your own), the same way a callback
is added by `_target_`.

The class is imported and its arguments checked against its signature in the `fw` process,
before anything is written (a misspelt class or argument is exit 2). Arguments a class takes as
`**kwargs` are checked, names and types, against the callable it hands them to
(TensorBoardLogger's SummaryWriter, WandbLogger's `wandb.init`, CometLogger's
`comet_ml.ExperimentConfig`), whose package must be installed. Where the class takes them and the
entry does not set them, the run fills in `save_dir` (RUN_DIR/NAME: each logger's files
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


def _tensorboard_writer() -> Any:
    """The SummaryWriter Lightning's TensorBoardLogger makes: torch's when tensorboard is
    installed, else tensorboardX's (lightning.fabric.loggers.tensorboard)."""
    from lightning.fabric.loggers.tensorboard import _TENSORBOARD_AVAILABLE

    if _TENSORBOARD_AVAILABLE:
        from torch.utils.tensorboard import SummaryWriter
    else:
        from tensorboardX import SummaryWriter
    return SummaryWriter


def _wandb_init() -> Any:
    import wandb

    return wandb.init


def _comet_config() -> Any:
    import comet_ml

    return comet_ml.ExperimentConfig


_TENSORBOARD = (_tensorboard_writer, ("log_dir", "logdir"), ())
# Where a class sends what it takes as **kwargs (Lightning 2.x's sources): (the receiver, the
# names the class passes it itself, which a user's would clash with or override; the names the
# class takes out of **kwargs for itself). A receiver that takes **kwargs too is looked up here
# again; tensorboardX's SummaryWriter passes its own to FileWriter, whose every parameter it sets.
FORWARDS: dict[str, tuple[Any, tuple[str, ...], tuple[str, ...]]] = {
    "lightning.pytorch.loggers.tensorboard.TensorBoardLogger": _TENSORBOARD,
    "lightning.fabric.loggers.tensorboard.TensorBoardLogger": _TENSORBOARD,
    "tensorboardX.writer.SummaryWriter": (None, (), ()),
    "lightning.pytorch.loggers.wandb.WandbLogger": (_wandb_init, (), ()),
    "lightning.pytorch.loggers.comet.CometLogger": (
        _comet_config,
        (),
        ("experiment_name", "project_name", "offline", "save_dir"),
    ),
}


def _qualified(obj: Any) -> str:
    return f"{obj.__module__}.{obj.__qualname__}"


def _public_name(obj: Any) -> str:
    """The shortest module path that exports `obj`: wandb.init, tensorboardX.SummaryWriter."""
    import sys

    parts = obj.__module__.split(".")
    for i in range(1, len(parts) + 1):
        module = ".".join(parts[:i])
        if getattr(sys.modules.get(module), obj.__name__, None) is obj:
            return f"{module}.{obj.__name__}"
    return _qualified(obj)


def _named(fn: Any) -> dict[str, inspect.Parameter]:
    params = inspect.signature(fn).parameters.values()
    skip = (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)
    return {p.name: p for p in params if p.kind not in skip and p.name != "self"}


def _takes_any(fn: Any) -> bool:
    return any(p.kind is p.VAR_KEYWORD for p in inspect.signature(fn).parameters.values())


def _hint(fn: Any, param: inspect.Parameter) -> Any:
    """The parameter's annotation, else the type of a plain default (flush_secs=120: int), else
    None (nothing to check)."""
    import typing

    try:
        hints = typing.get_type_hints(fn.__init__ if inspect.isclass(fn) else fn)
    except Exception:  # annotations that do not resolve here: the default's type, if plain
        hints = {}
    if param.name in hints:
        return hints[param.name]
    default = param.default
    plain = (bool, int, float, str)
    return type(default) if type(default) in plain else None


def check_forwarded(key: str, target: str, cls: Any, args: dict[str, Any]) -> None:
    """Before launch: the arguments of `cls` beyond its own parameters, which it takes as
    **kwargs, are parameters of the callable it hands them to (FORWARDS), with values of their
    type; that callable's package is installed. A class not listed there is left to its own
    signature."""
    from framework.config.fields import matches, type_name

    own = _named(cls)
    extra = {k: v for k, v in args.items() if k not in own}
    sender, names, receivers = cls, list(own), []
    while _qualified(sender) in FORWARDS:
        load, given, consumed = FORWARDS[_qualified(sender)]
        names += consumed
        extra = {k: v for k, v in extra.items() if k not in consumed}
        if load is None:
            break
        receiver = _receiver(key, target, cls, load)
        receivers.append(_public_name(receiver))
        params = {n: p for n, p in _named(receiver).items() if n not in given}
        names += params
        for name in [n for n in extra if n in params]:
            hint = _hint(receiver, params[name])
            if hint is not None and not matches(extra[name], hint):
                raise ConfigError(
                    f"{key}.{name}",
                    extra[name],
                    f"{cls.__name__} passes it to {receivers[-1]}, which expects {type_name(hint)}",
                )
            del extra[name]
        if not _takes_any(receiver):
            break
        sender = receiver
    else:
        return  # where the rest goes is not known here: the class's own checks stand
    if extra:
        name = next(iter(extra))
        through = f", nor of {', '.join(receivers)} that it passes the rest to" if receivers else ""
        raise ConfigError(
            f"{key}.{name}",
            extra[name],
            f"not an argument of {cls.__name__}{through}",
            sorted(dict.fromkeys(names)),
            near=str(name),
        )


def _receiver(key: str, target: str, cls: Any, load: Any) -> Any:
    """The callable `load` imports, or a ConfigError naming the package that is missing (the
    class would raise ModuleNotFoundError in every worker, after the run directory is made)."""
    try:
        return load()
    except ImportError as err:
        missing = getattr(err, "name", None) or str(err)
        raise ConfigError(
            f"{key}._target_",
            target,
            f"{cls.__name__} needs the package '{missing}', which is not installed",
            hint=f"Install it (pip install {missing}) or choose another logger.",
        ) from None


def build_target(name: str, node: DictConfig, ctx: Any) -> Any:
    """The logger `node._target_` names, in every worker (Lightning's loggers write on rank 0)."""
    from hydra.utils import get_class

    cls = get_class(node._target_)
    return cls(**filled(cls, arguments(node), name, ctx.run_dir, ctx.run_id))
