"""Compose the job config with Hydra's compose API, and turn Hydra's errors into ConfigErrors.

The `fw` process is the only one that composes: no `@hydra.main`, so Hydra neither changes the
working directory, nor creates `outputs/`, nor configures logging. Multirun sweeps
(`fw train -m seed=1,2`) are expanded here into one override list per job.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException, MissingConfigException, OverrideParseException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from framework.config.fields import schema_error
from framework.config.schema import TRAINER_OWNED
from framework.config.store import register
from framework.errors import ConfigError
from framework.secrets import redact_words

log = logging.getLogger("framework.config")

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
PRIMARY = "train"
GROUPS = ("task", "strategy", "trainer", "logger", "callbacks", "launcher", "experiment", "debug")


PRIMARY_STORED = "fw_train"  # train.yaml, stored: the primary when --config-dir comes first
# Hydra's own settings as a Hydra application's users write them, and the framework's key that
# does the same (None: already what fw does, nothing to change)
HYDRA_EQUIVALENTS = {
    "hydra.run.dir": "run.dir",
    "hydra.sweep.dir": "run.dir",
    "hydra.job.name": "run.name",
}
HYDRA_POINTERS = {
    "hydra.job.chdir": "The working directory never changes (workers start where fw was "
    "started; outputs go to run.dir)",
    "hydra.searchpath": "Give another directory of config groups with --config-dir DIR",
    "hydra.sweep.subdir": "A multirun's jobs go to run.dir/0, run.dir/1, ...",
    "hydra/launcher": "Choose how processes start with launcher=local|slurm|ray",
    "hydra/sweeper": "Search hyperparameters with fw sweep (Optuna)",
}


def search_dirs(extra: list[Path] | None = None) -> list[Path]:
    """Config directories in the order an option is looked up: the user's (--config-dir), then
    the built-in one. A user's option replaces a built-in option of the same name."""
    return [*(Path(p).resolve() for p in extra or []), CONF_DIR]


def hydra_overrides(overrides: list[str]) -> list[str]:
    """Overrides of Hydra's own settings (`hydra.run.dir=out/x`) as the framework's keys that do
    the same (`run.dir=out/x`); one that has no equivalent is refused, with what fw does
    instead. Other overrides are returned as they are."""
    out = []
    for override in overrides:
        key, eq, value = override.lstrip("+~").partition("=")
        if not key.startswith(("hydra.", "hydra/")):
            out.append(override)
            continue
        if key in HYDRA_EQUIVALENTS and eq:
            out.append(f"{HYDRA_EQUIVALENTS[key]}={value}")
            continue
        if key == "hydra.job.chdir" and value.strip().lower() == "false":
            continue  # what fw does anyway
        pointer = next((p for k, p in HYDRA_POINTERS.items() if key.startswith(k)), None)
        raise ConfigError(
            key,
            value or None,
            "fw composes its config with Hydra but runs no Hydra application, so Hydra's own "
            "settings do nothing here",
            hint=(f"{pointer}. " if pointer else "")
            + "hydra.run.dir and hydra.sweep.dir are run.dir, hydra.job.name is run.name; "
            "fw config prints every key fw has.",
        )
    return out


def group_options(group: str, extra: list[Path] | None = None) -> list[str]:
    """YAML options of a config group across all search directories."""
    names = set()
    for root in search_dirs(extra):
        names.update(p.stem for p in (root / group).glob("*.yaml"))
    return sorted(names)


def parse_overrides(overrides: list[str]):
    parser = OverridesParser.create()
    try:
        return parser.parse_overrides(overrides)
    except OverrideParseException as err:
        bad = next((o for o in overrides if not _parses(parser, o)), overrides[-1])
        raise ConfigError(
            "override",
            _shown([bad]),
            "not a valid override",
            hint="Write overrides as key=value (e.g. trainer.max_steps=100), "
            "+key=value to add a key, ~key to delete one.",
        ) from err


def _parses(parser, override: str) -> bool:
    try:
        parser.parse_overrides([override])
    except OverrideParseException:
        return False
    return True


def expand_sweeps(overrides: list[str]) -> list[list[str]]:
    """One override list per job: the cartesian product of every swept value (`a=1,2`)."""
    axes = []
    for o in parse_overrides(overrides):
        key = o.get_key_element()
        if o.is_sweep_override():
            axes.append([f"{key}={v}" for v in o.sweep_string_iterator()])
        else:
            axes.append([o.input_line])
    return [list(combo) for combo in itertools.product(*axes)]


def check_group_choices(overrides: list[str], extra: list[Path] | None = None) -> None:
    """Name the group and its options when an override selects an option that does not exist."""
    for o in parse_overrides(overrides):
        key = o.key_or_group.lstrip("+~")
        if key not in GROUPS or o.is_delete():
            continue
        value = o.value()
        chosen = value if isinstance(value, list) else [value]
        valid = group_options(key, extra)
        warn_shadowed(key, extra)
        for option in chosen:
            if option is not None and str(option) not in valid:
                raise ConfigError(key, option, f"no such option in group '{key}'", valid)


def warn_shadowed(group: str, extra: list[Path] | None) -> None:
    """A user option named like a built-in one replaces it: say so once, at DEBUG level ( it is
    what --config-dir is for, as with Hydra's search path)."""
    builtin = {p.stem for p in (CONF_DIR / group).glob("*.yaml")}
    for root in extra or []:
        for p in (Path(root) / group).glob("*.yaml"):
            if p.stem in builtin:
                log.debug("%s replaces the built-in option %s=%s", p, group, p.stem)


def compose_config(overrides: list[str], extra_dirs: list[Path] | None = None) -> DictConfig:
    """The composed (not yet resolved) config of one job, or a ConfigError."""
    register()
    overrides = hydra_overrides(overrides)
    if any(o.is_sweep_override() for o in parse_overrides(overrides)):
        raise ConfigError(
            "override", _shown(overrides), "sweeps (a=1,2) need multirun", hint="Add -m."
        )
    check_group_choices(overrides, extra_dirs)
    # Hydra looks an option up in its main directory first, then along hydra.searchpath: the
    # user's first directory is the main one, so their options replace the built-in ones of the
    # same name, and the primary config is train.yaml as stored (found whatever the main is)
    dirs = search_dirs(extra_dirs)
    primary = PRIMARY
    if len(dirs) > 1:
        primary = PRIMARY_STORED
        ConfigStore.instance().store(name=primary, node=OmegaConf.load(CONF_DIR / "train.yaml"))
    searchpath = [f"file://{p}" for p in dirs[1:]]
    search = [f"hydra.searchpath=[{','.join(searchpath)}]"] if searchpath else []
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(version_base="1.3", config_dir=str(dirs[0]), job_name="fw"):
            cfg = compose(primary, overrides=search + list(overrides))
    except (HydraException, OmegaConfBaseException) as err:
        raise translate(err, overrides) from None
    finally:
        GlobalHydra.instance().clear()
    return cfg


def translate(err: Exception, overrides: list[str]) -> ConfigError:
    """A one-paragraph ConfigError for a Hydra/OmegaConf composition failure."""
    cause = err.__cause__ if isinstance(err.__cause__, OmegaConfBaseException) else err
    if isinstance(cause, OmegaConfBaseException) and getattr(cause, "full_key", None):
        key = cause.full_key
        parent = getattr(cause, "parent_node", None)
        choices = [str(k) for k in parent] if isinstance(parent, DictConfig) else None
        error = schema_error(cause, key, _given(key, overrides), choices, hint=_add_hint(key))
        owned = (
            TRAINER_OWNED.get(key.removeprefix("trainer.")) if key.startswith("trainer.") else None
        )
        if owned is not None and error.problem == "no such key":
            return ConfigError(
                key,
                error.value,
                f"this lightning.Trainer argument is the framework's: set it with {owned}",
                near="",
            )
        owners = _options_with(key) if error.problem == "no such key" else []
        if not owners:
            return error
        group = key.split(".")[0]  # a key of other options of the group: say which
        chosen = _given(group, overrides)
        return ConfigError(
            key,
            error.value,
            f"no such key for {f'{group}={chosen}' if chosen != '?' else f'this {group}'}; "
            f"only {group}={', '.join(owners)} {'has' if len(owners) == 1 else 'have'} it",
            choices,
            near="",  # this option's keys are not what the user meant
        )
    text = str(err)
    if "full_key:" in text:  # an error inside a YAML file: Hydra only keeps the message
        where = text.splitlines()[0].split(":")[0]
        detail = next((line for line in text.splitlines()[1:] if line.strip()), "").strip()
        full_key = text.split("full_key:")[1].split()[0]
        return ConfigError(full_key, "?", f"{where}: {detail}".rstrip("."))
    if isinstance(err, MissingConfigException):
        first = str(err).splitlines()[0]
        return ConfigError("defaults", _shown(overrides), first)
    return ConfigError("config", _shown(overrides), str(err).splitlines()[0].rstrip("."))


def _shown(overrides: list[str]) -> str:
    """Override words as an error message may repeat them: values under secret keys, URL
    passwords and credentials replaced (a message that quotes the command line is printed)."""
    return " ".join(redact_words(overrides))


def _given(key: str, overrides: list[str]) -> str:
    for o in overrides:
        name, _, value = o.lstrip("+~").partition("=")
        if name == key:
            return value
    return "?"


def _options_with(key: str) -> list[str]:
    """The built-in options of a plugin group whose schema has the field `key` names
    (`strategy.fault_tolerance` -> ddp), so that a key given under another option can say
    where it belongs."""
    from framework.config.store import plugin_schemas

    group, _, field = key.partition(".")
    kinds = [
        kind
        for (family, kind), schema in plugin_schemas().items()
        if family == group and field in {f.name for f in dataclasses.fields(schema)}
    ]
    return sorted(
        p.stem
        for p in (CONF_DIR / group).glob("*.yaml")
        if any(f"/schema/{group}/{kind}@" in p.read_text() for kind in kinds)
    )


def _add_hint(key: str) -> str | None:
    if key.startswith(("task.model.", "task.data.", "task.optimizer.", "callbacks.", "logger.")):
        return f"To pass a new argument on purpose, write +{key}=VALUE."
    return None
