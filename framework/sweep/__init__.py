"""`fw sweep`: a hyperparameter search on Optuna, each trial an ordinary `fw train` job.

    fw sweep 'task.optimizer.lr=tag(log, interval(1e-4, 1e-2))' --trials 20 trainer.devices=2

The search space is written in Hydra's sweep grammar (framework/sweep/space.py); every other
override goes to each trial as written. Everything is checked before the first trial starts:
the flags, the `sweep` settings, and the trial config at the lowest and highest point of the
space (composed and validated as `fw train` would). The study is kept in `--storage` (default:
`<sweep dir>/optuna.db`, SQLite); the sweep directory is `run.dir` when given, else
`runs/sweeps/<study>`; the study's name is `--study`, else the sweep directory's name when
`run.dir` is given, else one derived from the command, so rerunning a command continues its study.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from framework.errors import ConfigError

log = logging.getLogger("framework.sweep")

USAGE = """\
usage: fw sweep --trials N [--study NAME] [--storage URL] [--config-dir DIR] [sweep=NAME]
                [sweep.KEY=VALUE ...] KEY=SEARCH ... [KEY=VALUE ...]
  SEARCH: interval(a, b) | range(a, b[, step]) | choice(x, y, ...) | x,y,... | tag(log, ...)
  sweep.metric=val/loss sweep.direction=minimize|maximize sweep.sampler=tpe|random
  sweep.pruner=median|successive_halving|none sweep.seed=N  (see docs/sweeps.md)
"""
FLAGS = ("--trials", "--study", "--storage")


def sweep_command(args: list[str], parse_args) -> int:
    """Plan the search, then run trials until the study holds `--trials` of them."""
    from framework.config.compose import search_dirs
    from framework.external import job_id
    from framework.sweep import config as sweep_config

    flags, rest = split_flags(args)
    multirun, dirs, overrides, want_help = parse_args(rest)
    if want_help:
        import sys

        sys.stdout.write(USAGE)
        return 0
    if multirun:
        raise ConfigError("-m", "multirun", "a search is not a grid", hint="Drop -m.")
    if job_id():
        raise ConfigError("command", "sweep", "a search cannot run inside a torchrun/SLURM job")
    trials = trials_flag(flags.get("--trials"))
    cfg, overrides = sweep_config.load(overrides, search_dirs(dirs))
    search = make_jobs(cfg, overrides, dirs, trials, flags)
    return run(search)


def split_flags(args: list[str]) -> tuple[dict[str, str], list[str]]:
    """({--trials/--study/--storage: value}, the other words)."""
    flags, rest = {}, []
    words = iter(args)
    for word in words:
        name, eq, value = word.partition("=")
        if name in FLAGS:
            value = value if eq else next(words, None)
            if value is None or value.startswith("--"):
                raise ConfigError(name, value, "expects a value", hint=USAGE.splitlines()[0])
            flags[name] = value
        else:
            rest.append(word)
    return flags, rest


def trials_flag(value: str | None) -> int:
    if value is None:
        raise ConfigError("--trials", None, "is required: how many trials the study should hold")
    try:
        trials = int(value)
    except ValueError:
        raise ConfigError("--trials", value, "expects a whole number") from None
    if trials < 1:
        raise ConfigError("--trials", trials, "must be at least 1")
    return trials


def make_jobs(cfg, overrides: list[str], dirs: list[Path], trials: int, flags: dict[str, str]):
    """The Search of this command, once its trials' config composes and validates."""
    from omegaconf import OmegaConf

    from framework import files, secrets
    from framework.sweep.space import corners, split_overrides
    from framework.sweep.study import Search

    written = dict(cfg.params)
    space, fixed = split_overrides([f"{k}={v}" for k, v in cfg.params.items()] + overrides)
    written.update({o.partition("=")[0]: o.partition("=")[2] for o in overrides if o not in fixed})
    if not space:
        raise ConfigError(
            "sweep",
            " ".join(secrets.redact_words(overrides)),
            "nothing to search",
            hint="Give at least one KEY=interval(a, b), KEY=range(a, b), KEY=choice(x, y) or "
            "KEY=x,y (or sweep.params in conf/sweep/*.yaml); a grid is `fw train -m`.",
        )
    refuse_secret_search(space, secrets.SECRET)
    given_dir = next((o for o in fixed if o.lstrip("+").startswith("run.dir=")), None)
    fixed = [o for o in fixed if o != given_dir]
    name = flags.get("--study") or study_name(given_dir, fixed, written, cfg)
    sweep_dir = Path(given_dir.partition("=")[2] if given_dir else f"runs/sweeps/{name}").resolve()
    storage = flags.get("--storage") or f"sqlite:///{sweep_dir / 'optuna.db'}"
    if not storage.startswith(("sqlite:", "postgresql", "mysql")):
        raise ConfigError(
            "--storage",
            secrets.redact_text(storage),
            "not a database URL",
            ["sqlite:///PATH", "postgresql://...", "mysql://..."],
        )
    job = check_trials(fixed, corners(space), dirs, sweep_dir)
    metrics_file, grouped = logger_roles(job.cfg)
    if metrics_file is None:
        raise ConfigError(
            "logger",
            ",".join(job.cfg.logger or {}) or "[]",
            "a search reads each trial's metric from its metrics.csv, written by the csv logger",
            hint="Keep it: e.g. logger=[csv] or logger=[csv,wandb].",
        )
    plain = OmegaConf.to_container(job.cfg)
    keys = tuple(job.cfg.run.secret_keys)
    refuse_secret_search(space, secrets.key_pattern(keys))
    return Search(
        cfg=cfg,
        space=space,
        written=written,
        fixed=fixed,
        config_dirs=[Path(d).resolve() for d in dirs],
        sweep_dir=sweep_dir,
        study_name=name,
        storage_url=storage,
        trials=trials,
        metrics_file=metrics_file,
        group_keys=tuple(f"logger.{name}.group" for name in grouped),
        secret_keys=keys,
        secret_values=frozenset(secrets.secret_values(plain, secrets.key_pattern(keys))),
        dir_mode=files.dir_mode(job.cfg.run.dir_mode),
    )


def refuse_secret_search(space: dict, pattern) -> None:
    """ConfigError for a search over a key that holds a secret: Optuna keeps every sampled
    value (and the choices) in its storage, in clear, and the trials are logged by value."""
    from framework import secrets

    for key in space:
        if any(secrets.is_secret_key(part, pattern) for part in key.lstrip("+").split(".")):
            raise ConfigError(
                key,
                "***",
                "a search over a secret would keep its values in the study's storage and logs",
                hint="Search over other keys; give the secret once, from the environment "
                "(e.g. 'KEY=${oc.env:NAME}'), or take the key out of run.secret_keys if it "
                "is no secret.",
            )


def logger_roles(cfg) -> tuple[str | None, list[str]]:
    """(The file of metric rows a trial's logger writes, the names of the loggers that group
    runs by a `group` field left unset), asked of the logger plugins."""
    from framework.plugins import capability, load_plugin, typed_config

    found, grouped = None, []
    for name, entry in (cfg.logger or {}).items():
        if entry is None or "kind" not in entry:
            continue
        plugin = load_plugin("logger", entry.kind, f"logger.{name}.kind")
        typed = typed_config(plugin, entry, f"logger.{name}")
        found = found or capability(plugin, "metrics_file", "logger")(typed)
        if capability(plugin, "groups_runs", "logger")(typed):
            grouped.append(name)
    return found, grouped


def study_name(given_dir: str | None, fixed: list[str], written: dict[str, str], cfg) -> str:
    """The run directory's name, else `sweep-` and a hash of what defines the search."""
    if given_dir:
        return Path(given_dir.partition("=")[2]).resolve().name
    key = json.dumps([sorted(fixed), sorted(written.items()), cfg.metric, cfg.direction])
    return "sweep-" + hashlib.sha256(key.encode()).hexdigest()[:8]


def check_trials(fixed: list[str], points: list[list[str]], dirs: list[Path], sweep_dir: Path):
    """Compose and validate a trial at each corner of the space, as `fw train` would."""
    from framework.runner import make_jobs as plan_jobs

    jobs = [
        plan_jobs([*fixed, *p, f"run.dir={sweep_dir / 'check'}"], False, dirs)[0] for p in points
    ]
    return jobs[0]


def run(search) -> int:
    """Run the search, then write the table, the best command and the plots."""
    from framework.sweep import report, study

    log.info(
        "Study %s (%s, %d trials) in %s; rerun this command to continue it.",
        search.study_name,
        search.shown_text(search.storage_url),
        search.trials,
        search.sweep_dir,
    )
    ran = study.run(search)
    log.info("This process ran trials %s.", ", ".join(map(str, ran)) or "(none)")
    opened = study.open_study(search)
    fixed = search.shown(search.fixed)  # the best command as printed: secrets replaced
    text = report.summary(opened, fixed, list(search.space), search.cfg.metric)
    for line in text.rstrip().splitlines():
        log.info("%s", line)
    report.write(opened, search.sweep_dir, text, search.cfg.metric)
    return 0
