"""`fw validate|test|predict RUN_DIR_OR_CHECKPOINT [KEY=VALUE ...]`: LightningCLI's commands of
the same names, on a trained run.

The config is the run's own (config.yaml, or the meta.json of a checkpoint outside any run
directory) with the overrides on top: a group chosen on the command line (`strategy=fsdp`,
`launcher=slurm`, `logger=[csv,tensorboard]`) replaces the run's setting of that group, a
`KEY=VALUE` changes one key, typed and checked as `fw train` checks them (exit 2 before
anything is written). The checkpoint is the run's `checkpoints/best` when the checkpoint
callback kept one (`callbacks.checkpoint.monitor`), else its newest complete one, or the
checkpoint named; it is read as a resume reads it, so any layout evaluates under any strategy
and process count. The run's config is data, as a resume treats it: what in it names code (a
`_target_`, an out-of-tree plugin `kind`, the SLURM launcher's shell lines and sbatch options, a
resolver such as `${oc.env:NAME}`) is used only when fw's config groups, the user's
--config-dir or their command line name the same, or with `--trust`; otherwise exit 2 before
anything is imported. The job runs like `fw train`'s (same launchers, one process or many) with
`command` set; its config goes to RUN_DIR/<command>.yaml beside config.yaml, which stays the
training's. What each command leaves (framework/runtime/evaluation.py): a row in
RUN_DIR/validate.csv or test.csv, also sent to the run's loggers (the same W&B run), and
printed here as a table; `predict` the outputs in RUN_DIR/predictions (framework.predictions
reads them back in the dataset's order).
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from framework.callbacks.checkpoint import chosen_checkpoint
from framework.checkpoint import disk
from framework.config.compose import (
    GROUPS,
    compose_config,
    hydra_overrides,
    parse_overrides,
    search_dirs,
)
from framework.errors import ConfigError

log = logging.getLogger("framework.evaluate")

COMMANDS = ("validate", "test", "predict")
PLUGIN_GROUPS = ("strategy", "launcher")  # a node typed by the plugin its `kind` names
NAMED_GROUPS = ("logger", "callbacks")  # entries typed by their plugin, or a `_target_`
# keys of a run's config a checkpoint's model depends on (an evaluation changes no optimizer)
MODEL_KEYS = ("task._target_", "task.model.")
# where a run's config names code: a `kind` with a dot is a plugin module, imported
PLUGIN_KIND = re.compile(r"^(strategy|launcher|(logger|callbacks)\.[^.]+)\.kind$")
SHELL_KEYS = ("launcher.setup", "launcher.sbatch")  # lines and options the SLURM job runs
CODE_NAMES = ("_target_", "kind", "setup", "sbatch")  # the last part of each such key
CODE_WHAT = {
    "_target_": "a class to build",
    "kind": "a plugin module to import",
    "setup": "shell lines for the SLURM job to run",
    "sbatch": "options for sbatch",
    "resolver": "a resolver to run (it reads your environment or files)",
}
RESOLVER = re.compile(r"\$\{\s*[\w.-]+\s*:")  # `${oc.env:NAME}`: run when the config resolves


def locate(source: str) -> tuple[Path, Path | None, dict[str, Any]]:
    """(checkpoint, its run directory or None, the config it was trained with) for a run
    directory or a checkpoint directory (`checkpoints/best`, `last`, `stepNNNNNNNN`)."""
    path = Path(source)
    if (path / "checkpoints").is_dir() and (path / "config.yaml").is_file():
        ckpt = chosen_checkpoint(path / "checkpoints")
        if ckpt is None:
            raise ConfigError("checkpoint", source, "this run directory has no complete checkpoint")
        return ckpt, path.resolve(), OmegaConf.to_container(OmegaConf.load(path / "config.yaml"))
    ckpt = disk.resolve(path, "checkpoint")
    run_dir = ckpt.parent.parent
    if (run_dir / "config.yaml").is_file():
        return ckpt, run_dir, OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml"))
    saved = disk.read_meta(ckpt).get("config")
    if not saved:
        raise ConfigError("checkpoint", source, "records no config and is in no run directory")
    return ckpt, None, saved


def split(overrides: list[str]) -> tuple[list[str], list[str]]:
    """(group choices such as strategy=fsdp, every other override)."""
    groups, keys = [], []
    for override, parsed in zip(overrides, parse_overrides(overrides), strict=True):
        name = parsed.key_or_group.lstrip("+~")
        chosen = name in GROUPS and not parsed.is_delete() and "." not in name
        (groups if chosen else keys).append(override)
    return groups, keys


def evaluation_config(
    saved: dict[str, Any],
    overrides: list[str],
    extra_dirs: list[Path] | None,
    trust: bool = False,
) -> DictConfig:
    """The run's config with the overrides on top (see the module docstring); unless `trust`,
    what it names of code is checked first (`check_code`)."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl

    overrides = hydra_overrides(overrides)
    groups, keys = split(overrides)
    chosen = {o.partition("=")[0].lstrip("+") for o in groups}
    for group in ("experiment", "debug"):
        if group in chosen:
            raise ConfigError(
                group,
                next(o.partition("=")[2] for o in groups if o.lstrip("+").startswith(group)),
                "sets the model and training of a run to train; an evaluation keeps the run's",
                hint="Change single keys instead (e.g. trainer.limit_test_batches=10).",
            )
    cfg = compose_config(groups, extra_dirs)  # the schema, with the groups chosen here
    kept = {k: v for k, v in without_redacted(saved).items() if k not in chosen and k in cfg}
    if not trust:  # before typed_node, which imports the plugin modules the kinds name
        check_code(kept, cfg, keys, extra_dirs)
    for key, value in kept.items():
        cfg[key] = typed_node(key, value, cfg[key])
    try:
        ConfigLoaderImpl._apply_overrides_to_config(parse_overrides(keys), cfg)
    except Exception as err:
        from framework.config.compose import translate

        raise translate(err, keys) from None
    return cfg


def code_places(node: Any, path: str = "") -> Iterator[tuple[str, str, Any]]:
    """(key, what, value) of each place in a saved config that names code, `what` one of
    CODE_WHAT: a `_target_` (a class built with its node's arguments), a plugin `kind` with a dot
    (a module imported), the SLURM launcher's `setup` lines and `sbatch` options when set, and a
    plain string using a resolver."""
    items = node.items() if isinstance(node, dict) else enumerate(node)
    for name, value in items:
        key = f"{path}.{name}" if path else str(name)
        if name == "_target_":
            yield key, "_target_", value
        elif name == "kind" and PLUGIN_KIND.match(key) and "." in str(value):
            yield key, "kind", value
        elif key in SHELL_KEYS and value:
            yield key, str(name), value
        elif isinstance(value, (dict, list)):
            yield from code_places(value, key)
        elif isinstance(value, str) and RESOLVER.search(value):
            yield key, "resolver", value


def _canonical(name: str, value: Any) -> str:
    return f"{name}={json.dumps(value, sort_keys=True, default=str)}"


def _named_code(node: Any, into: set[str]) -> None:
    """Add every value `node` holds under a key whose last part is one of CODE_NAMES."""
    items = node.items() if isinstance(node, dict) else enumerate(node)
    for name, value in items:
        last = str(name).rpartition(".")[2]  # `callbacks.x._target_:` written as one key too
        if last in CODE_NAMES:
            into.add(_canonical(last, value))
        if isinstance(value, (dict, list)):
            _named_code(value, into)


def vouched(composed: DictConfig, keys: list[str], extra_dirs: list[Path] | None) -> set[str]:
    """What the user's own configs name of code (canonical `name=value`): every option of fw's
    config groups and of their --config-dir, chosen or not, the config composed now, and the
    KEY=VALUE overrides of the command line."""
    import yaml

    found: set[str] = set()
    for root in search_dirs(extra_dirs):
        for path in sorted(root.rglob("*.yaml")):
            try:
                data = yaml.safe_load(path.read_text())
            except (OSError, yaml.YAMLError):
                continue  # Hydra names an unreadable option when it is chosen
            if isinstance(data, (dict, list)):
                _named_code(data, found)
    _named_code(OmegaConf.to_container(composed), found)
    for override in parse_overrides(keys):
        last = override.key_or_group.lstrip("+~").rpartition(".")[2]
        if last in CODE_NAMES and not override.is_delete():
            found.add(_canonical(last, override.value()))
    return found


def check_code(
    saved: dict[str, Any], composed: DictConfig, keys: list[str], extra_dirs: list[Path] | None
) -> None:
    """Refuse code a received config names that the user's own configs do not (`vouched`): a
    run directory or checkpoint someone else made runs nothing of theirs without `--trust`. A
    run of the user's own passes: its classes come from the same groups and command lines."""
    allowed: set[str] | None = None
    for key, what, value in code_places(saved):
        if what in CODE_NAMES:
            allowed = vouched(composed, keys, extra_dirs) if allowed is None else allowed
            if _canonical(what, value) in allowed:
                continue
        raise refusal(key, what, value)


def refusal(key: str, what: str, value: Any) -> ConfigError:
    """The one-paragraph refusal of code named at `key` (shell lines shown by kind only, a
    resolver by its name: they may hold a credential)."""
    shown = value
    if what == "resolver":
        shown = RESOLVER.search(str(value)).group(0) + "...}"
    elif what in ("setup", "sbatch"):
        count = len(value) if isinstance(value, (list, dict)) else 1
        shown = (
            f"({count} {'line' if what == 'setup' else 'option'}{'s' * (count != 1)}, not shown)"
        )
    return ConfigError(
        key,
        shown,
        f"the run's saved config names {CODE_WHAT[what]}, and neither fw's config groups, your "
        "--config-dir nor your command line name the same; a config you did not compose could "
        "run any code this way",
        hint="For a run of your own, give again the --config-dir it trained with, or set "
        f"{key} on the command line; if you trust whoever made this run, add --trust (its "
        "checkpoint is then read as it is too).",
    )


def without_redacted(node: Any) -> Any:
    """A saved config without the values config.yaml only holds as '***' (secrets: the
    defaults, or the overrides and environment given now, stand in)."""
    from framework.secrets import REDACTED

    if isinstance(node, dict):
        return {k: without_redacted(v) for k, v in node.items() if v != REDACTED}
    return node


def typed_node(key: str, value: Any, default: Any) -> Any:
    """A saved group's node, typed by its schema where there is one (so an override of one of
    its keys is checked): a plugin's `Config` by its kind, the core groups by theirs."""
    from framework.plugins import load_plugin

    if key in PLUGIN_GROUPS and isinstance(value, dict) and "kind" in value:
        plugin = load_plugin(key, value["kind"], f"{key}.kind")
        return OmegaConf.merge(OmegaConf.structured(plugin.Config), value)
    if key in NAMED_GROUPS and isinstance(value, dict):
        entries = {}
        for name, entry in value.items():
            if isinstance(entry, dict) and "kind" in entry and "_target_" not in entry:
                plugin = load_plugin(key, entry["kind"], f"{key}.{name}.kind")
                entry = OmegaConf.merge(OmegaConf.structured(plugin.Config), entry)
            entries[name] = entry
        return entries
    if isinstance(default, DictConfig) and isinstance(value, dict):
        node = OmegaConf.create(OmegaConf.to_container(default))
        typed = OmegaConf.get_type(default)
        if typed is not None and typed is not dict:
            node = OmegaConf.structured(typed)
        return OmegaConf.merge(node, value)
    return value


def check_model(ckpt: Path, cfg: DictConfig) -> None:
    """The task's model as configured is the one the checkpoint holds."""
    from framework.context import config_changes

    saved = disk.read_meta(ckpt).get("config", {})
    breaking, _ = config_changes(saved, OmegaConf.to_container(cfg))
    breaking = [line for line in breaking if line.startswith(MODEL_KEYS)]
    if breaking:
        raise ConfigError(
            "task",
            str(ckpt),
            "the checkpoint holds another model (" + "; ".join(breaking) + ")",
            hint="Evaluate with the model the run trained: drop those overrides.",
        )


def make_job(
    command: str,
    source: str,
    overrides: list[str],
    extra_dirs: list[Path] | None = None,
    trust: bool = False,
) -> Any:
    """The evaluation job, checked as `fw train` checks a job, before anything is written."""
    import functools

    from framework.checkpoint import resume
    from framework.config.validate import plan_job
    from framework.runner import Job, check_run_dir, resolve

    ckpt, run_dir, saved = locate(source)
    cfg = evaluation_config(saved, overrides, extra_dirs, trust)
    cfg.command = command
    if trust:
        cfg.run.trust_checkpoint = True
    given = _given_run_dir(overrides)
    target = Path(given) if given else run_dir or Path(time.strftime("runs/%Y-%m-%d_%H-%M-%S"))
    cfg.run.dir = str(target.resolve())
    cfg.resume = str(ckpt)
    resolve(cfg)
    plan = plan_job(cfg)
    if command == "predict" and plan.dims is not None and plan.dims.pp > 1:
        raise ConfigError(
            "strategy.pp",
            plan.dims.pp,
            "fw predict runs the task's predict_step on the whole model; under a pipeline no "
            "process holds it",
            hint="Predict under a layout without pipeline stages (strategy=fsdp|tensor|ddp): "
            "any of them reads this checkpoint.",
        )
    check_run_dir(Path(cfg.run.dir), cfg.run.allow_foreign_dir)
    resume.check_safe(ckpt, "checkpoint", cfg.run.trust_checkpoint)
    check_model(ckpt, cfg)
    plugin, strategy = plan.strategy_plugin, plan.strategy
    move = functools.partial(plugin.check_move, strategy)
    resume.check_layout(ckpt, plan.checkpoint_format, plan.world.world_size, move)
    return Job(plan, Path(cfg.run.dir), resume_from=ckpt)


def _given_run_dir(overrides: list[str]) -> str | None:
    for override in hydra_overrides(overrides):
        key, _, value = override.lstrip("+").partition("=")
        if key == "run.dir" and value:
            return value
    return None


def evaluate(
    command: str,
    source: str,
    overrides: list[str],
    extra_dirs: list[Path] | None = None,
    trust: bool = False,
) -> str:
    """Run `fw <command>` on `source`; returns what to print (the metrics as a table, or where
    the predictions are)."""
    from framework.runner import run_job

    job = make_job(command, source, overrides, extra_dirs, trust)
    if command == "predict":
        shutil.rmtree(job.run_dir / "predictions", ignore_errors=True)  # an earlier count's
    run_job(job, config_name=f"{command}.yaml")
    if command == "predict":
        count = len(list((job.run_dir / "predictions").glob("rank*.pt")))
        return (
            f"Predictions of {job.resume_from.name}: {job.run_dir / 'predictions'} "
            f"({count} file(s); framework.predictions.read puts them in the dataset's order)\n"
        )
    from framework.runtime.evaluation import read_results

    rows = read_results(job.run_dir, command)
    return table(rows[-1], job.run_dir / f"{command}.csv") if rows else ""


def table(row: dict[str, str], path: Path) -> str:
    """One evaluation's metrics, one per line, and where they are kept."""
    fixed = ("time", "checkpoint", "step", "processes", "strategy")
    metrics = {k: v for k, v in row.items() if k not in fixed and v not in ("", None)}
    width = max([len(k) for k in metrics] + [6])
    head = f"{row.get('checkpoint')} (step {row.get('step')}), {row.get('strategy')}"
    lines = [head, f"{'metric':<{width}}  value", f"{'-' * width}  {'-' * 12}"]
    lines += [f"{k:<{width}}  {float(v):.6g}" for k, v in sorted(metrics.items())]
    lines.append(f"(also in {path})")
    return "\n".join(lines) + "\n"
