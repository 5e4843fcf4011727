"""`fw validate|test|predict RUN_DIR_OR_CHECKPOINT [KEY=VALUE ...]`: LightningCLI's commands of
the same names, on a trained run.

The config is the run's own (config.yaml, or the meta.json of a checkpoint outside any run
directory) with the overrides on top: a group chosen on the command line (`strategy=fsdp`,
`launcher=slurm`, `logger=[csv,tensorboard]`) replaces the run's setting of that group, a
`KEY=VALUE` changes one key, typed and checked as `fw train` checks them (exit 2 before
anything is written). The checkpoint is the run's `checkpoints/best` when the checkpoint
callback kept one (`callbacks.checkpoint.monitor`), else its newest complete one, or the
checkpoint named; it is read as a resume reads it, so any layout evaluates under any strategy
and process count. The job runs like `fw train`'s (same launchers, one process or many) with
`command` set; its config goes to RUN_DIR/<command>.yaml beside config.yaml, which stays the
training's. What each command leaves (framework/runtime/evaluation.py): a row in
RUN_DIR/validate.csv or test.csv, also sent to the run's loggers (the same W&B run), and
printed here as a table; `predict` the outputs in RUN_DIR/predictions (framework.predictions
reads them back in the dataset's order).
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from framework.callbacks.checkpoint import chosen_checkpoint
from framework.checkpoint import disk
from framework.config.compose import GROUPS, compose_config, hydra_overrides, parse_overrides
from framework.errors import ConfigError

log = logging.getLogger("framework.evaluate")

COMMANDS = ("validate", "test", "predict")
PLUGIN_GROUPS = ("strategy", "launcher")  # a node typed by the plugin its `kind` names
NAMED_GROUPS = ("logger", "callbacks")  # entries typed by their plugin, or a `_target_`
# keys of a run's config a checkpoint's model depends on (an evaluation changes no optimizer)
MODEL_KEYS = ("task._target_", "task.model.")


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
    saved: dict[str, Any], overrides: list[str], extra_dirs: list[Path] | None
) -> DictConfig:
    """The run's config with the overrides on top (see the module docstring)."""
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
    for key, value in without_redacted(saved).items():
        if key in chosen or key not in cfg:
            continue
        cfg[key] = typed_node(key, value, cfg[key])
    try:
        ConfigLoaderImpl._apply_overrides_to_config(parse_overrides(keys), cfg)
    except Exception as err:
        from framework.config.compose import translate

        raise translate(err, keys) from None
    return cfg


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
    cfg = evaluation_config(saved, overrides, extra_dirs)
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
    if not cfg.run.trust_checkpoint:
        resume.check_safe(ckpt, "checkpoint")
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
