"""The plugin contract, written down once, and how plugins are found.

A strategy, logger, callback or launcher plugin is one module (or package) chosen by the `kind`
of its config node. A `kind` without a dot is looked up in the package of that plugin family
(`strategy.kind=ddp` is `framework.strategies.ddp`); a dotted `kind` is imported as is, so plugins
can live outside the framework. The module provides every name of its family's protocol below;
the runner (in the `fw` process, before anything is written or started) and the worker (in each
training process) call them directly, with everything they need passed in as arguments.

Each hook receives its own config node as an instance of the module's `Config` dataclass
(`typed_config`), in the `fw` process and in the workers alike. Each process types a strategy
or launcher node once: validation makes the job's plan (framework/config/job_plan.py), which
holds the typed configs and the strategy's answers, and hands it on.

Besides its required hooks a strategy module may define the optional members of
`StrategyCapabilities` (what `fw check`, `fw plan`, validation and the run's messages ask of a
strategy), and a launcher module those of `LauncherCapabilities`; `capability(module, name)`
gives the module's own or the default written there. Code
outside a plugin's package asks these, never the plugin's `kind`. The objects plugins build have
optional hooks too, written down as `CheckpointUploader` and `SeparateWriter` (loggers) and
`DataModuleHooks` (the user's data module).
"""

from __future__ import annotations

import dataclasses
import importlib
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from framework.errors import ConfigError

if TYPE_CHECKING:
    from collections.abc import Callable

    from framework.context import RunContext
    from framework.parallel.dims import ParallelDims
    from framework.strategy_base import StrategyInputs
    from framework.world import World

FAMILIES = {
    "strategy": "framework.strategies",
    "logger": "framework.loggers",
    "callbacks": "framework.callbacks",
    "launcher": "framework.launchers",
}


@dataclasses.dataclass(frozen=True)
class JobView:
    """The parts of a job's config a strategy may check its own settings against."""

    task: Any  # the `task` node: _target_, model, data, optimizer, scheduler
    trainer: Any  # the `trainer` node
    model: Any = None  # the task built on the meta device (no memory, no weights), or None


class StrategyPlugin(Protocol):
    """A strategy plugin module: how the work is spread over processes.

    Called in this order: `validate`, then (making the job's plan) `checkpoint_format` and
    `data_parallel`, then `check_move` (when the resume checkpoint was written by another
    layout) in the `fw` process; `checkpoint_format`, `data_parallel` and `build` in every
    worker process (a worker in the `fw` process asks `data_parallel` again only when its rank
    differs from the plan's). Each is called once per process.
    """

    Config: type  # the dataclass schema of `strategy.*`, registered as schema/strategy/<kind>

    def validate(self, cfg: Any, world: World, job: JobView) -> None:
        """Raise ConfigError for any setting that cannot work for this process layout, task or
        trainer. Runs in the `fw` process before anything is written or started."""

    def checkpoint_format(self, cfg: Any, world: World) -> str:
        """The layout of the checkpoints this strategy writes (recorded in meta.json as
        "format"): `lightning`, `deepspeed`, `dcp`, `dcp_flat`, or a new one registered in
        framework.checkpoint.formats (one object with its reader)."""

    def check_move(self, cfg: Any, source: str) -> None:
        """Raise ConfigError when this strategy cannot take in a checkpoint written by another
        layout or process count (`source` describes it); do nothing when it can."""

    def data_parallel(self, cfg: Any, world: World) -> tuple[int, int]:
        """(rank, size) of this process among the ranks that read different data: (world.rank,
        world.world_size) when every process reads its own batch."""

    def build(self, cfg: Any, world: World, inputs: StrategyInputs) -> Any:
        """The lightning.pytorch Strategy for this worker. Built strategies mix in
        `framework.strategy_base.StrategyBase` (inputs, moves from other layouts, samplers)
        and apply `inputs.transforms` to the task's blocks before data-parallel wrapping."""


class StrategyCapabilities(Protocol):
    """Optional members of a strategy plugin module, each with its default here (a module that
    lacks one gets it). `fw check`, `fw plan`, validation and the run's messages call them
    through `capability`."""

    @staticmethod
    def describe(cfg: Any, world: World | None) -> str:
        """The strategy in a few words. With `world`: the layout `fw check` and `fw plan` report
        (`ddp x 8`, `zero3 x 8`, `pp=2 x fsdp=4`); with None: the setting as written, for the
        message that a resume moves a checkpoint between strategies (`zero2`)."""
        return str(cfg.kind) if world is None else f"{cfg.kind} x {world.world_size}"

    @staticmethod
    def mesh_dims(cfg: Any, world: World) -> ParallelDims | None:
        """The degrees on one DeviceMesh, for a strategy built on `framework.parallel`: `fw
        check` then simulates representative ranks on the fake backend as `parallelize` applies
        them (the pipeline and tensor-parallel settings read from the fields of `cfg` named as
        the parallel plugin's) and checks their device placement. None (default): every process
        holds one whole replica, simulated once."""
        return None

    @staticmethod
    def model_states(
        cfg: Any, world: World, replica: Any, precision: str
    ) -> tuple[Any, str | None]:
        """A rank's memory (a framework.preflight.simulate.RankMemory) from the figures of one
        whole replica (`fw check`, for a strategy whose `mesh_dims` is None), and a note on how
        it was estimated. Default: the replica as it is (replicated model states), no note."""
        return replica, None

    @staticmethod
    def preflight_notes(cfg: Any, world: World) -> list[str]:
        """Lines `fw check` prints under its table: where its simulation differs from the job."""
        return []

    @staticmethod
    def saves_async(cfg: Any, world: World) -> bool:
        """Whether the Lightning strategy `build` returns writes checkpoints in the background
        (answers `StrategyBase.save_async`); `callbacks.checkpoint.async_save` is refused before
        launch otherwise. Default: False."""
        return False

    @staticmethod
    def check_services(cfg: Any, world: World) -> None:
        """Raise ConfigError when a running service the settings name does not answer (a
        torchft lighthouse). Validation calls it for `fw train` only, before launch: `fw check`
        and `fw plan` predict the job and do not need its services up. Default: none."""

    @staticmethod
    def data_traffic(cfg: Any, world: World, grads: int, params: int) -> float:
        """Bytes one rank sends per optimizer step to keep the data-parallel ranks in step
        (`fw plan`), given its own bytes of gradients and of parameters. Default: an all-reduce
        of the gradients, 2 * grads (ring volume, the (N-1)/N factor left out)."""
        return 2 * grads

    @staticmethod
    def plan_candidates(gpus: int, tp_limit: int) -> list[tuple[str, list[str]]]:
        """The layouts `fw plan` tries for this plugin over `gpus` processes, as (label,
        overrides), tensor parallel at most `tp_limit` (within a node). Default: none, the
        plugin is not proposed (it is still checked when the config chooses it)."""
        return []

    @staticmethod
    def data_overlap(cfg: Any, world: World) -> float:
        """The share of the data-parallel bytes (`data_traffic`) sent while backward still
        computes (`fw plan`'s communication term hides all of that share but its last bucket
        behind compute); the rest blocks the step. Default: all of them (an all-reduce in
        buckets as the gradients become ready, or gathers prefetched ahead of the compute)."""
        return 1.0

    @staticmethod
    def data_collectives(cfg: Any, world: World, grads: int, params: int) -> int | None:
        """Blocking collectives one step issues to keep the data-parallel ranks in step, given
        the rank's bytes of gradients and of parameters (`fw plan` charges each its wait).
        Default None: one per 25 MiB bucket of `data_traffic` (DDP's)."""
        return None


class LauncherCapabilities(Protocol):
    """Optional members of a launcher plugin module, each with its default here; validation
    calls them through `capability(module, name, "launcher")`."""

    @staticmethod
    def checks_devices(cfg: Any) -> bool:
        """Whether the launcher's `validate` checks `trainer.devices` against the machines the
        ranks run on (a Ray cluster's resources), so validation does not hold the job to the
        devices of the machine `fw` runs on. Default: False, the ranks run on this machine (or,
        for several nodes, on machines like it)."""
        return False


class LoggerCapabilities(Protocol):
    """Optional members of a logger plugin module, each with its default here; validation and
    `fw sweep` call them through `capability(module, name, "logger")`."""

    @staticmethod
    def metrics_file(cfg: Any) -> str | None:
        """The file in the run directory holding one row per logged step (`fw sweep` reads each
        trial's metric there). Default: None, the logger writes no such file."""
        return None

    @staticmethod
    def check_job(cfg: Any, name: str, job: Any) -> None:
        """Raise ConfigError for a setting that the rest of the job's config (`job`, the composed
        DictConfig) cannot serve, e.g. checkpoints uploaded without a checkpoint callback.
        `name`: the entry's name (`logger.<name>`). Default: nothing to check."""

    @staticmethod
    def groups_runs(cfg: Any) -> bool:
        """Whether the logger groups runs by a `group` field left unset here, which `fw sweep`
        sets to the study's name for every trial. Default: False."""
        return False


CAPABILITIES = {
    "strategy": StrategyCapabilities,
    "launcher": LauncherCapabilities,
    "logger": LoggerCapabilities,
}


def capability(module: ModuleType, name: str, family: str = "strategy") -> Callable[..., Any]:
    """A plugin module's optional member `name`, or its default in its family's capabilities
    (`StrategyCapabilities`, `LauncherCapabilities`)."""
    default = getattr(CAPABILITIES[family], name)  # an unknown name fails here, not later
    return getattr(module, name, default)


def describe_strategy(config: dict[str, Any]) -> str:
    """A job config's strategy as its plugin describes the setting (`zero2`), or its kind when
    the plugin cannot read it (a checkpoint of a plugin no longer installed, or of old fields)."""
    strategy = config.get("strategy") or {}
    kind = str(strategy.get("kind", "<absent>"))
    try:
        plugin = load_plugin("strategy", kind, "strategy.kind")
        return capability(plugin, "describe")(typed_config(plugin, strategy, "strategy"), None)
    except (ConfigError, ImportError):
        return kind


@runtime_checkable
class CheckpointUploader(Protocol):
    """Optional methods of the lightning Logger a logger plugin's `build` returns: a logger that
    has them is handed each committed checkpoint (W&B's `log_model`). Called on rank 0 by the
    checkpoint callback (framework/callbacks/checkpoint/callback.py)."""

    def log_checkpoint(self, path: Path, meta: dict[str, Any], best: bool) -> None:
        """A checkpoint directory was committed (`meta`: its meta.json; `best`: it beats every
        earlier one on `callbacks.checkpoint.monitor`). Copy or upload it; may return before
        the upload is done."""

    def wait_staged(self) -> None:
        """Return once every checkpoint handed over is copied, so that it may be pruned."""

    def log_staged(self) -> None:
        """Log the uploads whose copies are done (called at every step boundary)."""


@runtime_checkable
class SeparateWriter(Protocol):
    """An optional method of a lightning Logger whose records are written by another process
    (W&B's service). Called on rank 0 by the checkpoint callback, after `Logger.save()`."""

    def wait_received(self) -> None:
        """Return once the metrics logged so far are written by the logger's own process (before
        a checkpoint of that step is committed: a resume never lacks a row before it)."""


@runtime_checkable
class DataModuleHooks(Protocol):
    """Optional methods of the user's LightningDataModule that the framework calls."""

    def check_ready(self, key: str) -> None:
        """Raise ConfigError (naming `key`, e.g. `task.data`) when the data cannot be loaded as
        configured, e.g. a prepared dataset that is not there. Called by the dry build in the
        `fw` process, after the constructor and before anything is written or started."""


class LoggerPlugin(Protocol):
    """A logger plugin module (`logger.<name>.kind`)."""

    Config: type

    def validate(self, cfg: Any, world: World) -> None:
        """Raise ConfigError for a setting that cannot work. Runs in the `fw` process."""

    def build(self, cfg: Any, ctx: RunContext) -> Any:
        """A lightning Logger, or None to log nothing (e.g. disabled). Runs in every worker."""


class CallbackPlugin(Protocol):
    """A callback plugin module (`callbacks.<name>.kind`)."""

    Config: type

    def validate(self, cfg: Any, world: World) -> None:
        """Raise ConfigError for a setting that cannot work. Runs in the `fw` process."""

    def build(self, cfg: Any, ctx: RunContext) -> Any:
        """A lightning Callback. Runs in every worker."""


class LauncherPlugin(Protocol):
    """A launcher plugin module (`launcher.kind`): starts the workers of one job."""

    Config: type

    def validate(self, cfg: Any, world: World) -> None:
        """Raise ConfigError for a setting that cannot work. Runs in the `fw` process."""

    def join(self, cfg: Any, world: World, config: dict) -> bool:
        """Before the run directory is written: for a job over several machines, meet the other
        nodes (raise ConfigError when their `config` differs from this node's). Returns whether
        this node writes the run directory. Runs in the `fw` process."""

    def build(self, cfg: Any, plan: Any) -> Callable[[Path, Path | None], None]:
        """A function `launch(config_path, resume_from)` that runs the job's workers (each
        enters through `framework.worker.entry`) and returns when they are done. `plan`: the
        job as validation planned it (a framework.config.job_plan.JobPlan, which imports this
        module; `plan.world` is its process layout); a worker in this process trains from it
        (`entry(..., plan=plan)`), a worker process makes its own from config.yaml. Runs in
        the `fw` process."""


PROTOCOLS: dict[str, type] = {
    "strategy": StrategyPlugin,
    "logger": LoggerPlugin,
    "callbacks": CallbackPlugin,
    "launcher": LauncherPlugin,
}


def required_names(family: str) -> list[str]:
    """The names a plugin module of `family` must define."""
    protocol = PROTOCOLS[family]
    hooks = [n for n, v in vars(protocol).items() if callable(v) and not n.startswith("_")]
    return [*protocol.__annotations__, *hooks]


def builtin_kinds(family: str, ordered: bool = False) -> list[str]:
    """Names of the plugins shipped with the framework for one family (its package's `KINDS`:
    a module of the package that is not listed there is a helper, never a kind), sorted, or in
    the family's own order."""
    kinds = list(importlib.import_module(FAMILIES[family]).KINDS)
    return kinds if ordered else sorted(kinds)


def load_plugin(family: str, kind: str, key: str) -> ModuleType:
    """The module implementing `kind`, or a ConfigError naming `key` and the valid kinds."""
    name = kind if "." in kind else f"{FAMILIES[family]}.{kind}"
    if "." not in kind and kind not in builtin_kinds(family):
        raise ConfigError(key, kind, f"no {family} plugin of that kind", builtin_kinds(family))
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as err:
        if err.name is not None and name.startswith(err.name):
            raise ConfigError(
                key, kind, f"no {family} plugin of that kind", builtin_kinds(family)
            ) from None
        raise
    missing = [n for n in required_names(family) if not hasattr(module, n)]
    if missing:
        raise ConfigError(
            key,
            kind,
            f"module {name} is not a {family} plugin: it lacks {', '.join(missing)}",
            hint="See docs/strategies.md, 'Adding a strategy plugin', for what a plugin defines.",
        )
    return module


def typed_config(module: ModuleType, node: Any, key: str = "") -> Any:
    """A plugin's config node as an instance of its `Config` dataclass, or a ConfigError naming
    the key (`key` is the node's place, e.g. `strategy`) when a field is unknown or mistyped.

    Built-in plugins' nodes are typed at compose time already; an out-of-tree plugin's schema
    is not registered with Hydra, so this is where its fields are checked."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from framework.config.fields import check_fields, schema_error

    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        return node
    if isinstance(node, dict):  # a checkpoint's saved config
        node = OmegaConf.create(node)
    try:
        typed = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(module.Config), node))
    except OmegaConfBaseException as err:
        field = getattr(err, "full_key", "") or ""
        where = ".".join(p for p in (key, field) if p) or key or "config"
        value = OmegaConf.select(node, field) if field else None
        names = [f.name for f in dataclasses.fields(module.Config)]
        raise schema_error(err, where, value, names) from None
    check_fields(typed, f"{key}." if key else "")
    return typed
