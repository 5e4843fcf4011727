"""`fw prepare [--workers N] [--engine local|ray] OVERRIDES`: run the task's data module's
`prepare(workers)` once, before training, with the config `fw train` would compose (e.g. the gpt
recipe's byte tokens into `task.data.prepared`; see framework/data/prepared.py and docs/data.md).

`--engine ray` calls `prepare(workers, engine="ray")` instead: the same output written by Ray Data
tasks, on this machine or on the cluster `RAY_ADDRESS` names. A data module whose `prepare` takes
no `engine` is refused with it.

Only the task's data section is checked and built here (a preparation needs no model); what
`fw train` checks besides is checked when it starts.
"""

from __future__ import annotations

import inspect
import logging
import os
import sys

from framework.errors import ConfigError

log = logging.getLogger("framework.prepare")


def prepare_command(args: list[str], parse) -> int:
    from framework.config.compose import compose_config
    from framework.config.validate import check_fields, check_task
    from framework.data.prepared import ENGINES
    from framework.instantiate import instantiate_args
    from framework.preflight.options import take_option
    from framework.runner import resolve

    workers, args = take_option(args, "--workers")
    engine, args = take_option(args, "--engine")
    count = os.cpu_count() or 1
    if workers is not None and (not workers.isdigit() or int(workers) < 1):
        raise ConfigError("--workers", workers, "must be a whole number of processes, at least 1")
    if engine is not None and engine not in ENGINES:
        raise ConfigError("--engine", engine, "is not a preparation engine", list(ENGINES))
    multirun, dirs, overrides, _ = parse(args)
    if multirun:
        raise ConfigError("-m", "multirun", "fw prepare prepares one dataset")
    cfg = compose_config(overrides, dirs)
    resolve(cfg)
    check_fields(cfg, "")
    check_task(cfg.task)
    data = instantiate_args(cfg.task.data)
    hook = getattr(data, "prepare", None)
    if not callable(hook):
        raise ConfigError(
            "task.data._target_",
            cfg.task.data._target_,
            "has no prepare(workers) method: there is nothing to prepare",
            hint="See docs/data.md for writing one with framework.data.prepared.prepare.",
        )
    workers = int(workers) if workers else count
    if engine in (None, "local"):
        done = hook(workers)
    elif "engine" in inspect.signature(hook).parameters:
        done = hook(workers, engine=engine)
    else:
        raise ConfigError(
            "--engine",
            engine,
            f"{cfg.task.data._target_}.prepare(workers) takes no engine",
            hint="Pass an engine argument on to framework.data.prepared.prepare (docs/data.md).",
        )
    where = getattr(data, "prepared", None)
    sys.stdout.write(
        f"{'Prepared' if done else 'Already prepared, nothing to do'}: {where}\n"
        if where
        else ("Prepared.\n" if done else "Already prepared.\n")
    )
    return 0
