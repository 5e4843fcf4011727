"""`fw train`: compose -> validate -> resolve -> run directory -> launch workers -> fit.

Everything that can be wrong with a config is found before anything is written or started; then
each job gets its own run directory holding the frozen `config.yaml` that its workers read.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import secrets
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from framework import external, files
from framework.checkpoint import disk, resume
from framework.config.compose import compose_config, expand_sweeps
from framework.config.job_plan import JobPlan
from framework.config.validate import plan_job
from framework.context import flatten, load_run_state
from framework.errors import EXIT_PREEMPTED, EXIT_TERMINATED, ConfigError
from framework.plugins import load_plugin, typed_config
from framework.secrets import ENV as SECRETS_ENV
from framework.secrets import key_pattern, redact
from framework.world import World

log = logging.getLogger("framework.runner")


@dataclass
class Job:
    """One training run: its plan (config, layout, typed plugin configs), run directory and
    resume point."""

    plan: JobPlan
    run_dir: Path
    resume_from: Path | None = None
    group: str | None = None

    @property
    def cfg(self) -> DictConfig:
        """The resolved config (secret values in place)."""
        return self.plan.cfg

    @property
    def world(self) -> World:
        return self.plan.world


def make_jobs(
    overrides: list[str],
    multirun: bool = False,
    extra_dirs: list[Path] | None = None,
    trust: bool = False,
) -> list[Job]:
    """Compose, resolve and validate every job of the command before any of them starts
    (`trust`, `fw train --trust`: `run.trust_checkpoint=true`, resume from a checkpoint whose
    pickles name more than data, framework/checkpoint/safe.py)."""
    enclosing = external.job_id()  # torchrun's or SLURM's
    if multirun and enclosing:
        raise ConfigError("-m", "multirun", "a sweep cannot run inside a torchrun/SLURM job")
    if trust:
        overrides = [*overrides, "run.trust_checkpoint=true"]
    sweep = expand_sweeps(overrides) if multirun else [list(overrides)]
    base = Path(enclosing and f"runs/{enclosing}" or time.strftime("runs/%Y-%m-%d_%H-%M-%S"))
    jobs: list[Job] = []
    for number, job_overrides in enumerate(sweep):
        cfg = compose_config(job_overrides, extra_dirs)
        if cfg.command != "fit":
            raise ConfigError(
                "command",
                cfg.command,
                "is set by the command: fw train fits",
                hint=f"Run fw {cfg.command} RUN_DIR_OR_CHECKPOINT [KEY=VALUE ...].",
            )
        given = cfg.run.dir
        run_dir = Path(given) if given is not None else base
        group = base.name if multirun else None
        if multirun and not _sweeps_key("run.dir", overrides):
            group = run_dir.resolve().name  # the sweep's directory names the W&B group
            run_dir = run_dir / str(number)
        cfg.run.dir = str(run_dir.resolve())
        resolve(cfg)
        validated = plan_job(cfg)
        if enclosing:
            external.check_world(validated.world)
        jobs.append(Job(validated, Path(cfg.run.dir), group=group))
    for job in jobs:
        check_run_dir(job.run_dir, job.cfg.run.allow_foreign_dir)
        plugin, strategy = job.plan.strategy_plugin, job.plan.strategy
        job.resume_from = resume.choose(
            job.cfg.resume,
            job.run_dir,
            redacted_config(job),
            job.plan.checkpoint_format,
            job.world.world_size,
            functools.partial(plugin.check_move, strategy),
            trust=job.cfg.run.trust_checkpoint,
        )
    dirs = [j.run_dir for j in jobs]
    if len(set(dirs)) != len(dirs):
        raise ConfigError("run.dir", str(dirs[0]), "several jobs of the sweep would share it")
    return jobs


def _sweeps_key(key: str, overrides: list[str]) -> bool:
    """Whether a multirun sweeps over `key` (then each job names its own value)."""
    from framework.config.compose import parse_overrides

    return any(
        o.get_key_element().lstrip("+") == key and o.is_sweep_override()
        for o in parse_overrides(overrides)
    )


def resolve(cfg: DictConfig) -> None:
    try:
        OmegaConf.resolve(cfg)
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or "config"
        raise ConfigError(key, "?", str(err).splitlines()[0].rstrip(".")) from None


def check_run_dir(run_dir: Path, allow_foreign: bool = False) -> None:
    """The run directory is a directory of this user's (or `allow_foreign`), or can be
    created."""
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError("run.dir", str(run_dir), "exists and is not a directory")
    owner = run_dir.stat().st_uid if run_dir.exists() else os.geteuid()
    if owner != os.geteuid() and not allow_foreign:
        raise ConfigError(
            "run.dir",
            str(run_dir),
            f"is owned by another user ({_user_name(owner)}): its checkpoints, config.yaml and "
            "run.json are theirs to write, and resuming would load what they put there",
            hint="Use a directory of your own, or add run.allow_foreign_dir=true if you trust "
            "its owner.",
        )
    ancestor = run_dir
    while not ancestor.exists():
        ancestor = ancestor.parent
    if (
        not ancestor.is_dir()
        or not os.access(ancestor, os.W_OK | os.X_OK)
        or not _can_create_in(ancestor)
    ):
        raise ConfigError("run.dir", str(run_dir), f"cannot be created: {ancestor} is not writable")


def _user_name(uid: int) -> str:
    import pwd

    try:
        return f"{pwd.getpwuid(uid).pw_name}, uid {uid}"
    except KeyError:
        return f"uid {uid}"


def _can_create_in(directory: Path) -> bool:
    """Really try (permissions alone say yes to root on read-only or virtual file systems)."""
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".fw-probe-", dir=directory))
    except OSError:
        return False
    return True


def write_config(job: Job, state: bool = True, name: str = "config.yaml") -> Path:
    """Create the run directory; write config.yaml (secrets redacted; an evaluation's config
    under its own `name`, e.g. test.yaml) and, with `state`, run.json, atomically.

    run.json keeps the run id chosen at the first start, so restarts log to the same W&B run.
    """
    mode = files.dir_mode(job.cfg.run.dir_mode)
    files.make_dir(job.run_dir, mode)
    files.make_dir(job.run_dir / "checkpoints", mode)
    path = job.run_dir / name
    if state:
        write_run_state(job)
    disk.write_text_atomic(path, OmegaConf.to_yaml(OmegaConf.create(redacted_config(job))))
    return path


def write_run_state(job: Job) -> None:
    """run.json: the run id (a W&B agent's, else a new one, kept from the first start) and the
    W&B group."""
    state = load_run_state(job.run_dir)
    # a W&B sweep agent names the run it starts: a single job takes that id (and so joins the
    # agent's sweep); the jobs of a multirun get their own
    agent = os.environ.get("WANDB_RUN_ID") if job.group is None else None
    state.setdefault("run_id", agent or new_run_id())
    state["group"] = state.get("group") or job.group
    disk.write_json_atomic(job.run_dir / "run.json", state)


def redacted_config(job: Job) -> dict:
    """The job's config as written to config.yaml: secret values replaced."""
    return redact(OmegaConf.to_container(job.cfg), key_pattern(job.cfg.run.secret_keys))


def pass_secrets(job: Job) -> None:
    """The secret values config.yaml leaves out reach this machine's workers by environment."""
    plain = OmegaConf.to_container(job.cfg)
    hidden = flatten(redact(plain, key_pattern(job.cfg.run.secret_keys)))
    secret = {k: v for k, v in flatten(plain).items() if hidden.get(k) != v}
    os.environ[SECRETS_ENV] = json.dumps(secret)


def new_run_id() -> str:
    """8 lowercase letters and digits, the shape W&B uses for run ids."""
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789"
    return "".join(secrets.choice(alphabet) for _ in range(8))


def job_launcher(
    cfg: DictConfig, planned: tuple[ModuleType, Any] | None = None
) -> tuple[ModuleType, Any]:
    """The launcher plugin of a job and its typed config: inside torchrun/srun, where this
    process is its rank already, framework.external; elsewhere the one `launcher.kind` names
    (`planned`: as the job's plan holds it, typed by validation)."""
    if external.job_id() is not None:
        return external, external.Config()
    if planned is not None:
        return planned
    launcher = load_plugin("launcher", cfg.launcher.kind, "launcher.kind")
    return launcher, typed_config(launcher, cfg.launcher)


def run_job(job: Job, config_name: str = "config.yaml") -> None:
    """Hand the job to its launcher, which starts its workers (or trains here, for one process
    or as this process's rank inside torchrun/srun). The workers read the job's config from
    `config_name` in the run directory (an evaluation's: validate.yaml, test.yaml, ...)."""
    launcher, launcher_cfg = job_launcher(job.cfg, (job.plan.launcher_plugin, job.plan.launcher))
    # several machines: the first node to arrive writes, once every node has the same config;
    # inside torchrun/srun: rank 0
    writes = launcher.join(launcher_cfg, job.world, redacted_config(job))
    pass_secrets(job)
    # every process writes config.yaml: the ranks of torchrun/srun start together and each
    # reads it at once (they composed the same config, and the last atomic write wins)
    config_path = write_config(job, state=writes, name=config_name)
    if writes:
        log.info("Run directory: %s", job.run_dir)
    launch = launcher.build(launcher_cfg, job.plan)
    launch(config_path, job.resume_from)


def train(
    overrides: list[str],
    multirun: bool = False,
    extra_dirs: list[Path] | None = None,
    trust: bool = False,
) -> None:
    """Plan every job, then run them one after another; a failed job does not stop the sweep."""
    jobs = make_jobs(overrides, multirun, extra_dirs, trust)
    failed = []
    for number, job in enumerate(jobs):
        if multirun:
            log.info("Job %d/%d", number + 1, len(jobs))
        try:
            run_job(job)
        except Exception as err:
            if not multirun or getattr(err, "exit_code", None) in (EXIT_PREEMPTED, EXIT_TERMINATED):
                raise  # a preempted sweep stops here; rerunning it resumes every job
            log.error("Job %d (%s) failed: %s", number, job.run_dir, err)
            failed.append(err)
    if failed:
        raise failed[0]
