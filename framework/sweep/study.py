"""The search loop of `fw sweep` on one Optuna study, shared by any number of `fw sweep` processes.

Each process, under a lock on the sweep directory, marks the trials whose sweep process died as
failed, counts the trials finished or running, and asks the study for a new trial while that count
is below `--trials`; then it runs the trial as an ordinary `fw train` job in `<sweep dir>/<number>`
and tells the study its outcome. The study lives in the storage (an SQLite file in the sweep
directory by default), so rerunning the command continues it and several processes share it.
"""

from __future__ import annotations

import contextlib
import csv
import fcntl
import functools
import json
import logging
import math
import os
import signal
import socket
import subprocess
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from framework import files, secrets
from framework.errors import EXIT_CONFIG, ConfigError
from framework.processes import python
from framework.sweep import config as sweep_config
from framework.sweep.space import literal, override

log = logging.getLogger("framework.sweep")

PRUNED_FILE = "pruned.json"  # written into a trial's run directory by its pruning callback
TRIAL_LOG = "train.log"  # the trial's `fw train` output
FAILURES_IN_A_ROW = 3  # then the search stops: something is wrong with every trial, not one
HOST, PID = "fw_host", "fw_pid"  # user attributes of a trial: which process runs it


@dataclass
class Search:
    """One `fw sweep` command: the settings, the space, and how its trials are started."""

    cfg: sweep_config.SweepConfig
    space: dict[str, Any]  # key -> Optuna distribution
    written: dict[str, str]  # key -> the search as written (recorded in the study)
    fixed: list[str]  # overrides every trial gets
    config_dirs: list[Path]
    sweep_dir: Path
    study_name: str
    storage_url: str
    trials: int
    metrics_file: str  # the csv logger's file name in a trial's run directory
    group_keys: tuple[str, ...]  # `logger.<name>.group` of the loggers that group runs (W&B)
    secret_keys: tuple[str, ...] = ()  # the trials' run.secret_keys
    secret_values: frozenset[str] = frozenset()  # values never to write (framework.secrets)
    dir_mode: int = files.DIR_MODE  # the trials' run.dir_mode, also that of the sweep directory

    def shown(self, words: list[str]) -> list[str]:
        """Command-line words as the sweep writes or prints them: secrets replaced."""
        pattern = secrets.key_pattern(self.secret_keys)
        return secrets.redact_words(words, pattern, self.secret_values)

    def shown_text(self, text: str) -> str:
        return secrets.redact_text(text, self.secret_values)


def open_storage(url: str, heartbeat_s: int | None = None) -> Any:
    """Optuna's database storage for `url` (SQLite waits for a peer's write instead of failing).
    With `heartbeat_s`, a running trial whose heartbeat is older than three intervals is stale."""
    import optuna

    # Heartbeats through ask/tell, not Study.optimize: Optuna warns about it, and about the
    # feature being experimental, at every trial; the sweep says what happens itself.
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used")
    engine = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else None
    beats = (
        {"heartbeat_interval": heartbeat_s, "grace_period": 3 * heartbeat_s} if heartbeat_s else {}
    )
    return optuna.storages.RDBStorage(url, engine_kwargs=engine, **beats)


def open_study(search: Search) -> Any:
    """Create the study, or load it when it exists and was started by the same command."""
    import optuna
    from sqlalchemy.exc import SQLAlchemyError

    optuna.logging.set_verbosity(optuna.logging.WARNING)  # the sweep says what happens itself
    cfg = search.cfg
    files.make_dir(search.sweep_dir, search.dir_mode)
    try:
        with locked(search.sweep_dir):  # two processes creating one SQLite file collide
            create_sqlite_file(search.storage_url)
            study = optuna.create_study(
                study_name=search.study_name,
                storage=open_storage(search.storage_url, cfg.heartbeat_s),
                sampler=sweep_config.sampler(cfg, cfg.seed),
                pruner=sweep_config.pruner(cfg.pruner, cfg.pruner_args),
                direction=cfg.direction,
                load_if_exists=True,
            )
    except (SQLAlchemyError, ValueError, ImportError) as err:
        problem = search.shown_text(str(err).splitlines()[0])
        raise ConfigError("--storage", search.shown_text(search.storage_url), problem) from None
    if study.direction.name.lower() != cfg.direction:
        raise ConfigError(
            "sweep.direction",
            cfg.direction,
            f"study '{search.study_name}' already exists and maximises/minimises the other way "
            f"({study.direction.name.lower()})",
            hint="Use the same direction, or another --study.",
        )
    # recorded in the database as shown: secrets replaced (a study started before they were
    # is still continued by the same command)
    command = {"fixed": search.shown(search.fixed), "space": search.written, "metric": cfg.metric}
    recorded = study.user_attrs.get("fw_command")
    if recorded is None:
        study.set_user_attr("fw_command", command)
    elif recorded not in (command, {**command, "fixed": search.fixed}):
        raise ConfigError(
            "--study",
            search.study_name,
            f"the study exists in {search.shown_text(search.storage_url)} and was started by "
            f"another search ({search.shown_text(str(recorded))})",
            hint="Continue it with the same overrides and search space, or give another --study.",
        )
    return study


def run(search: Search) -> list[int]:
    """Run trials until the study holds `search.trials` finished or running ones; returns the
    numbers of the trials this process ran."""
    study = open_study(search)
    ran: list[int] = []
    failed_in_a_row = 0
    while (trial := next_trial(study, search)) is not None:
        ran.append(trial.number)
        ok = run_trial(study, trial, search)
        failed_in_a_row = 0 if ok else failed_in_a_row + 1
        if failed_in_a_row >= FAILURES_IN_A_ROW:
            log.error("%d trials in a row failed: stopping the search.", failed_in_a_row)
            break
    return ran


def create_sqlite_file(url: str) -> None:
    """The study's SQLite file, created 0640 before SQLite creates it with the umask's mode (its
    journal files take the same mode)."""
    path = url.removeprefix("sqlite:///")
    if url.startswith("sqlite:///") and path and not path.startswith(":memory:"):
        with contextlib.suppress(OSError):  # no such folder: SQLite says so, as --storage's error
            files.create_new(Path(path.partition("?")[0]))


@contextlib.contextmanager
def locked(sweep_dir: Path) -> Iterator[None]:
    """Only one process at a time counts the trials and asks for the next one."""
    with files.open_lock(sweep_dir / ".lock") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def next_trial(study: Any, search: Search) -> Any:
    """A new trial, or None when enough trials are finished or running."""
    from optuna.trial import TrialState

    with locked(search.sweep_dir):
        fail_orphans(study)
        trials = study.get_trials(deepcopy=False)
        counted = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING)
        if sum(t.state in counted for t in trials) >= search.trials:
            return None
        if search.cfg.seed is not None:  # a new draw for each trial, the same on a rerun
            study.sampler = sweep_config.sampler(search.cfg, search.cfg.seed + len(trials))
        # The trial is queued with this process's host and pid, so it is RUNNING with them from
        # its first write: a process killed while the sampler draws leaves a trial the next
        # sweep can attribute (and fail), not one running forever. A trial queued by a process
        # killed before asking is taken by the next ask, which writes its own host and pid.
        owner = {HOST: socket.gethostname(), PID: os.getpid()}
        study.enqueue_trial({}, user_attrs=owner)
        try:
            trial = study.ask(search.space)
        except ValueError as err:  # a distribution that conflicts with the study's trials
            raise ConfigError("--study", search.study_name, str(err).rstrip(".")) from None
        for key, value in owner.items():
            trial.set_user_attr(key, value)
    return trial


def fail_orphans(study: Any) -> None:
    """A trial left running by a sweep process that is gone (killed, crashed) is marked failed:
    it is not counted, and the search runs another in its place. On this machine the process is
    looked up; on another, the trial's heartbeat tells (stale after three intervals)."""
    import optuna
    from optuna.trial import TrialState

    running = {t.number for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))}
    optuna.storages.fail_stale_trials(study)
    for t in study.get_trials(deepcopy=False, states=(TrialState.FAIL,)):
        if t.number in running:
            log.warning(
                "Trial %d sent no heartbeat for three intervals (its sweep process on %s "
                "stopped): marked failed, not counted; another trial takes its place.",
                t.number,
                t.user_attrs.get(HOST, "another machine"),
            )
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        pid = t.user_attrs.get(PID)
        if t.user_attrs.get(HOST) != socket.gethostname() or pid is None or alive(pid):
            continue
        study.tell(t.number, state=TrialState.FAIL)
        log.warning(
            "Trial %d was running when its sweep process (pid %d) stopped: marked failed, not "
            "counted; another trial takes its place.",
            t.number,
            pid,
        )


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def run_trial(study: Any, trial: Any, search: Search) -> bool:
    """Train one trial and tell the study how it ended; returns False when it failed."""
    from optuna.trial import TrialState

    run_dir = files.make_dir(search.sweep_dir / str(trial.number), search.dir_mode)
    sampled = [override(key, trial.params[key]) for key in search.space]
    log.info("Trial %d: %s", trial.number, " ".join(sampled))
    try:
        with heartbeat(study, trial, search.cfg.heartbeat_s):
            command = trial_command(search, trial.number, sampled, run_dir)
            code = train(command, run_dir / TRIAL_LOG, search.shown(command))
    except BaseException:  # interrupted: the trial did not finish (its `fw train` is stopped)
        study.tell(trial.number, state=TrialState.FAIL)
        raise
    if code == 0 and (run_dir / PRUNED_FILE).is_file():
        pruned = json.loads((run_dir / PRUNED_FILE).read_text())
        study.tell(trial.number, state=TrialState.PRUNED)
        log.info(
            "Trial %d pruned at step %d (%s=%.6g).",
            trial.number,
            pruned["step"],
            search.cfg.metric,
            pruned["value"],
        )
        return True
    if code != 0:
        study.tell(trial.number, state=TrialState.FAIL)
        if code == EXIT_CONFIG:
            raise ConfigError(
                "trial",
                trial.number,
                f"fw train refused it: {last_error(run_dir / TRIAL_LOG).rstrip('.')}",
                hint=f"The study is kept; its output is in {run_dir / TRIAL_LOG}.",
            )
        log.error("Trial %d failed (exit code %d): see %s", trial.number, code, run_dir / TRIAL_LOG)
        return False
    value = read_metric(run_dir / search.metrics_file, search.cfg.metric, study, trial.number)
    study.tell(trial.number, value)
    state = "finished" if math.isfinite(value) else "failed (not a finite value)"
    log.info("Trial %d %s: %s=%.6g", trial.number, state, search.cfg.metric, value)
    return math.isfinite(value)


@contextlib.contextmanager
def heartbeat(study: Any, trial: Any, interval_s: int) -> Iterator[None]:
    """Record the trial's heartbeat in the study every `interval_s` while it runs, so that sweep
    processes on other machines can tell it is alive."""
    storage, trial_id = study._storage, trial._trial_id  # Optuna keeps these two private
    stop = threading.Event()

    def beat() -> None:
        while True:
            try:
                storage.record_heartbeat(trial_id)
            except Exception as err:  # a busy or unreachable database: try again next time
                log.warning("Trial %d: heartbeat not recorded (%s)", trial.number, err)
            if stop.wait(interval_s):
                return

    thread = threading.Thread(target=beat, daemon=True, name=f"heartbeat-{trial.number}")
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def trial_command(search: Search, number: int, sampled: list[str], run_dir: Path) -> list[str]:
    """`fw train` with the fixed overrides, the sampled values, the trial's run directory and
    the pruning callback that reports to the study."""
    dirs = [f"--config-dir={d}" for d in search.config_dirs]
    words = [*dirs, *search.fixed, *sampled, f"run.dir={literal(str(run_dir))}"]
    if search.cfg.pruner != "none":
        words += [
            "+trial=pruning",  # conf/trial/pruning.yaml: the callback's typed entry
            f"callbacks.pruning.storage={literal(search.storage_url)}",
            f"callbacks.pruning.study={literal(search.study_name)}",
            f"callbacks.pruning.trial={number}",
            f"callbacks.pruning.metric={literal(search.cfg.metric)}",
            f"callbacks.pruning.pruner={search.cfg.pruner}",
        ]
        words += [
            f"+callbacks.pruning.pruner_args.{k}={literal(v)}"
            for k, v in search.cfg.pruner_args.items()
        ]
    words += [f"{key}={literal(search.study_name)}" for key in search.group_keys]
    return python("-m", "framework.cli", "train", *words)  # -P: no module from the cwd


def train(command: list[str], log_file: Path, shown: list[str]) -> int:
    """Run the trial's `fw train` with its output in `log_file` (headed by the command as
    `shown`, secrets replaced); it gets SIGTERM (checkpoint and stop) if this process dies
    first."""
    from framework.processes import die_with_parent

    with files.open_append(log_file) as out:
        out.write(f"$ {' '.join(shown)}\n".encode())
        out.flush()
        return subprocess.call(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=functools.partial(die_with_parent, signal.SIGTERM),
        )


def last_error(log_file: Path) -> str:
    lines = [ln for ln in log_file.read_text(errors="replace").splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("error: ")]
    return (errors or lines or ["(no output)"])[-1].removeprefix("error: ")


def read_metric(path: Path, metric: str, study: Any, number: int) -> float:
    """The last value of `metric` in a trial's metrics.csv; a ConfigError (the trial marked
    failed, the study kept) when the task never logs it."""
    from optuna.trial import TrialState

    rows, names = [], []
    if path.is_file():
        with path.open(newline="") as fh:
            reader = csv.DictReader(fh)
            rows = [r[metric] for r in reader if r.get(metric)]
            names = [n for n in reader.fieldnames or [] if n not in ("step", "epoch")]
    if rows:
        return float(rows[-1])
    study.tell(number, state=TrialState.FAIL)
    raise ConfigError(
        "sweep.metric",
        metric,
        f"trial {number} finished without logging it ({path})",
        names,
        hint="The study is kept. Rerun with a metric the task logs (that makes a new study).",
    )
