"""Checks run in the `fw` process after composing and before anything is written or started.

Each check raises ConfigError naming the key, the value and what would be valid.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
import typing
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from framework import lr_scaling
from framework.config import commands, job_plan
from framework.config.batches import check_batches
from framework.config.dry_build import dry_build
from framework.config.fields import check_fields, matches, type_name
from framework.config.schema import TRAINER_OWNED
from framework.errors import ConfigError
from framework.parallel import float8
from framework.plugins import JobView, capability, load_plugin, typed_config
from framework.world import World, cuda_device_count

NAMED_FAMILIES = ("logger", "callbacks")  # groups whose entries are `name: {kind or _target_}`


def plan_job(cfg: DictConfig, here: bool = True) -> job_plan.JobPlan:
    """Validate a composed, resolved config; returns the job's plan (framework/config/job_plan.py),
    which the runner hands on instead of deriving anything again. `here=False` (`fw check`)
    validates it for the machines it names, not this one: `auto` means CUDA, and neither the
    devices present nor the launcher's tools here are asked for (the plan has no launcher)."""
    check_trainer_owned(cfg.trainer)
    check_fields(cfg, "")
    launcher = load_plugin("launcher", cfg.launcher.kind, "launcher.kind")
    if here:  # this machine's devices, unless the launcher checks those its ranks run on
        launcher_cfg = typed_config(launcher, cfg.launcher, "launcher")
        elsewhere = capability(launcher, "checks_devices", "launcher")(launcher_cfg)
        world = check_world(cfg, elsewhere)
    else:
        world = target_world(cfg)
    check_task(cfg.task)
    check_trainer(cfg)
    classes = (
        import_target("task._target_", cfg.task._target_),
        import_target("task.data._target_", cfg.task.data._target_),
    )
    if cfg.get("command", "fit") != "fit":
        commands.check_command(cfg.command, cfg.task, *classes)
    elif cfg.trainer.get("test_after_fit"):
        commands.check_test_after_fit(*classes)
    lr_scaling.check(cfg.trainer)
    float8.check(cfg.trainer, world, here)
    model, data = dry_build(cfg.task)
    plugin = load_plugin("strategy", cfg.strategy.kind, "strategy.kind")
    strategy = typed_config(plugin, cfg.strategy, "strategy")
    plugin.validate(strategy, world, JobView(cfg.task, cfg.trainer, model))
    plan = job_plan.make(cfg, world, plugin, strategy)
    check_batches(cfg.trainer, data, plan.data_parallel[1])
    if not plan.saves_async:
        check_foreground_saves(cfg, plan.checkpoint_format)
    check_loggers(cfg)
    if here:  # the services the job needs answer now (fw check and fw plan only predict)
        capability(plugin, "check_services")(strategy, world)
        launcher.validate(launcher_cfg, world)
        plan = dataclasses.replace(plan, launcher_plugin=launcher, launcher=launcher_cfg)
    for family in NAMED_FAMILIES:
        for name, entry in (cfg.get(family) or {}).items():
            check_named_entry(family, name, entry, world)
    if cfg.get("command", "fit") == "fit":  # a note, once the job has passed every check
        commands.note_unvalidated(cfg.trainer, *classes)
    return plan


MAX_TIME_UNITS = ("days", "hours", "minutes", "seconds", "milliseconds", "microseconds", "weeks")


def check_trainer(cfg: DictConfig) -> None:
    """The lightning.Trainer arguments whose type the schema leaves open (`Any`) hold what
    Lightning takes; the ones the framework sets itself are refused with where to set them."""
    trainer = cfg.trainer
    fast = trainer.fast_dev_run
    if not (isinstance(fast, bool) or (isinstance(fast, int) and fast >= 0)):
        raise ConfigError("trainer.fast_dev_run", fast, "expected true, false or a number >= 0")
    check_max_time(trainer.max_time)
    limit = trainer.limit_train_batches
    if (
        cfg.get("command", "fit") == "fit"
        and limit == 0
        and not isinstance(limit, bool)
        and not fast
        and not trainer.overfit_batches
    ):
        raise ConfigError(
            "trainer.limit_train_batches",
            limit,
            "training on no batches does nothing",
            hint="To evaluate a run or a checkpoint, use fw validate RUN or fw test RUN "
            "(fw predict RUN for its outputs), with overrides as for fw train.",
        )
    if trainer.use_distributed_sampler is not None and cfg.task.data_order == "global":
        raise ConfigError(
            "trainer.use_distributed_sampler",
            trainer.use_distributed_sampler,
            "task.data_order=global gives the loaders one seeded order over the processes "
            "itself, in place of Lightning's DistributedSampler",
            hint="Add task.data_order=keep to leave the loaders (and this setting) to Lightning.",
        )


def check_trainer_owned(trainer: DictConfig) -> None:
    """A lightning.Trainer argument the framework sets itself, added to `trainer` with +KEY,
    is refused with where to set it instead."""
    for key in trainer:
        if key in TRAINER_OWNED:
            raise ConfigError(
                f"trainer.{key}",
                trainer[key],
                f"this lightning.Trainer argument is the framework's: set it with "
                f"{TRAINER_OWNED[key]}",
            )


def check_max_time(value: Any) -> None:
    """`trainer.max_time` as Lightning's Timer reads it: 'DD:HH:MM:SS' or a dict of timedelta
    units."""
    if value is None:
        return
    if isinstance(value, DictConfig):
        unknown = [k for k in value if k not in MAX_TIME_UNITS]
        numbers = all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in value.values()
        )
        if not unknown and numbers and value:
            return
    elif isinstance(value, str):
        parts = value.split(":")
        if len(parts) == 4 and all(p.isdigit() for p in parts):
            return
    raise ConfigError(
        "trainer.max_time",
        value,
        "expected 'DD:HH:MM:SS' or {days:, hours:, minutes:, seconds:}",
        hint="E.g. trainer.max_time=00:11:50:00 (11 h 50 min) or "
        "'trainer.max_time={hours: 11, minutes: 50}'.",
    )


def check_foreground_saves(cfg: DictConfig, ckpt_format: str) -> None:
    """For a strategy that writes its checkpoints in the foreground only (its plugin's
    `saves_async` is false): no background writes asked for."""
    ckpt = (cfg.get("callbacks") or {}).get("checkpoint")
    if ckpt is not None and ckpt.get("async_save"):
        raise ConfigError(
            "callbacks.checkpoint.async_save",
            True,
            f"the {cfg.strategy.kind} strategies write '{ckpt_format}' checkpoints, which are "
            "saved in the foreground only",
            hint="Use strategy=fsdp|tensor|fsdp_tp|pipeline|expert, or async_save=false.",
        )


def check_loggers(cfg: DictConfig) -> None:
    """Each built-in logger's settings against the rest of the job (its plugin's `check_job`:
    e.g. W&B's checkpoint uploads need checkpoints)."""
    for name, entry in (cfg.get("logger") or {}).items():
        if not isinstance(entry, DictConfig) or "kind" not in entry:
            continue
        plugin = load_plugin("logger", entry.kind, f"logger.{name}.kind")
        typed = typed_config(plugin, entry, f"logger.{name}")
        capability(plugin, "check_job", "logger")(typed, name, cfg)


def check_world(cfg: DictConfig, elsewhere: bool = False) -> World:
    """The job's process layout; unless its ranks run `elsewhere` (a launcher that checks the
    devices there itself), the devices of this machine must hold `trainer.devices`."""
    trainer = cfg.trainer
    for key in ("devices", "num_nodes"):
        if trainer[key] < 1:
            raise ConfigError(f"trainer.{key}", trainer[key], "must be at least 1")
    world = World.planned(trainer)
    if elsewhere:
        return world
    if world.is_cuda:
        available = cuda_device_count()
        if trainer.accelerator in ("gpu", "cuda") and available == 0:
            raise ConfigError(
                "trainer.accelerator",
                trainer.accelerator,
                "no CUDA device is available",
                ["cpu", "auto"],
            )
        if world.devices > available:
            raise ConfigError(
                "trainer.devices",
                world.devices,
                f"more than the {available} CUDA devices of this machine",
                [str(n) for n in range(1, available + 1)],
            )
    else:
        per_core = int(cfg.launcher.get("processes_per_core", 2))
        limit = (os.cpu_count() or 1) * per_core
        if world.devices > limit:
            raise ConfigError(
                "trainer.devices",
                world.devices,
                f"more CPU processes than this machine allows ({os.cpu_count()} cores x "
                f"launcher.processes_per_core={per_core})",
                [str(n) for n in range(1, limit + 1)],
            )
    return world


def target_world(cfg: DictConfig) -> World:
    """The layout the trainer config asks for on the machines it is meant for."""
    trainer = cfg.trainer
    accelerator = "cpu" if trainer.accelerator == "cpu" else "cuda"
    devices, nodes = int(trainer.devices), int(trainer.num_nodes)
    return World(devices * nodes, devices, nodes, accelerator)


def check_named_entry(family: str, name: str, entry: Any, world: World) -> None:
    key = f"{family}.{name}"
    if entry is None:
        return  # disabled with `{family}.{name}=null`
    if not isinstance(entry, DictConfig) or ("kind" not in entry and "_target_" not in entry):
        raise ConfigError(
            key, entry, "an entry needs `kind` (a built-in plugin) or `_target_` (a class)"
        )
    if "_target_" in entry:
        if family == "logger":
            from framework.loggers import targets

            cls = import_target(f"{key}._target_", entry._target_)
            args = targets.checked(key, entry, cls)
            check_arguments(key, cls, args)
            targets.check_forwarded(key, entry._target_, cls, args)
            return
        import_target(f"{key}._target_", entry._target_)
        return
    plugin = load_plugin(family, entry.kind, f"{key}.kind")
    plugin.validate(typed_config(plugin, entry, key), world)


def import_target(key: str, path: str) -> Any:
    """The object a dotted path names, or a ConfigError."""
    module_name, _, attr = str(path).rpartition(".")
    try:
        module = importlib.import_module(module_name) if module_name else None
    except ModuleNotFoundError as err:
        if err.name and module_name.startswith(err.name):
            raise ConfigError(
                key,
                path,
                f"module '{err.name}' cannot be imported",
                hint="Check the spelling and that the package is installed.",
            ) from None
        raise
    if module is None or not hasattr(module, attr):
        members = sorted(n for n in dir(module) if not n.startswith("_")) if module else []
        raise ConfigError(key, path, "no such class", [f"{module_name}.{m}" for m in members])
    return getattr(module, attr)


def check_task(task: DictConfig) -> None:
    """Import the task, data and optimizer classes; check their arguments against signatures."""
    import lightning.pytorch as pl

    cls = import_target("task._target_", task._target_)
    if not (inspect.isclass(cls) and issubclass(cls, pl.LightningModule)):
        raise ConfigError("task._target_", task._target_, "not a LightningModule subclass")
    check_arguments("task.model", cls, task.model)
    if "_target_" not in task.data:
        raise ConfigError("task.data._target_", None, "missing: name the LightningDataModule class")
    data_args = {k: v for k, v in task.data.items() if k != "_target_"}
    data_cls = import_target("task.data._target_", task.data._target_)
    if not (inspect.isclass(data_cls) and issubclass(data_cls, pl.LightningDataModule)):
        raise ConfigError(
            "task.data._target_", task.data._target_, "not a LightningDataModule subclass"
        )
    check_arguments("task.data", data_cls, data_args)
    opt_args = {k: v for k, v in task.optimizer.items() if k != "_target_"}
    opt_cls = import_target("task.optimizer._target_", task.optimizer._target_)
    check_arguments("task.optimizer", opt_cls, opt_args, skip=("params",))
    for prefix, owner, args in (
        ("task.model", cls, task.model),
        ("task.data", data_cls, data_args),
    ):
        hook = getattr(owner, "validate_config", None)
        if callable(hook):
            hook(prefix, OmegaConf.to_container(OmegaConf.create(dict(args)), resolve=True))


def check_arguments(prefix: str, cls: type, args: Any, skip: tuple[str, ...] = ()) -> None:
    """Every argument is a parameter of `cls.__init__` with a value of the annotated type."""
    params = {n: p for n, p in inspect.signature(cls).parameters.items() if n not in skip}
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    try:
        hints = typing.get_type_hints(cls.__init__)
    except Exception:  # unresolvable annotations: check names only
        hints = {}
    named = [n for n, p in params.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    for name in args:
        if name not in params and not takes_any:
            raise ConfigError(
                f"{prefix}.{name}",
                args[name],
                f"not an argument of {cls.__name__}",
                named,
                near=str(name),
            )
        value = args[name]
        if isinstance(value, (DictConfig, ListConfig)):
            value = OmegaConf.to_container(value, resolve=True)
        if name in hints and not matches(value, hints[name]):
            raise ConfigError(f"{prefix}.{name}", value, f"expected {type_name(hints[name])}")
    for name, p in params.items():
        if (
            p.default is p.empty
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
            and name not in args
        ):
            raise ConfigError(
                f"{prefix}.{name}",
                None,
                f"required argument of {cls.__name__} is missing",
                hint=f"Set it with +{prefix}.{name}=VALUE.",
            )
