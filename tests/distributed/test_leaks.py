"""No secret reaches a file or the console through `fw sweep`: not one given under a secret key,
nor a credential from the environment under any key (on the command line or through
`${oc.env:...}`), nor the password of a URL; the task still gets the real values. What the sweep
and its trial write is 0640 in directories 0750. Nor through an exception the task raises, in one
process or in a worker of several."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from recipes.digits.task import DigitsTask
from tests.conftest import FW, QUIET, fw_env

pytestmark = pytest.mark.slow

FROM_ENV = "hf_env7c2d9e4b"  # HF_TOKEN's value
BY_KEY = "key-1f8a6c3b"  # given under a secret key
IN_URL = "urlpw-4d9e2a7f"  # the password of a URL under a key that is not secret
SHORT = "Zq4Wx"  # a short value under a secret key: scrubbed where it stands alone
SECRETS = (FROM_ENV, BY_KEY, IN_URL, SHORT)


def umask() -> int:
    current = os.umask(0o022)
    os.umask(current)
    return current


def test_a_sweep_leaks_no_secret_and_keeps_its_files_private(workdir):
    env = fw_env()
    env["HF_TOKEN"] = FROM_ENV
    args = [
        "sweep",
        "task.model.hidden=choice(8, 16)",
        "--trials",
        "1",
        "sweep.metric=train/loss",
        "task._target_=tests.tasks.TokenDigits",
        "~task.model.dropout",
        # TokenDigits fails when it is handed '***' instead of the real token
        "+task.model.api_token=${oc.env:HF_TOKEN}",
        f"+extra.api_token={BY_KEY}",
        f"+extra.db_pwd={SHORT}",
        f"+extra.note={FROM_ENV}",  # as `+extra.note=$HF_TOKEN` from a shell
        f'+extra.mirror="https://fw:{IN_URL}@example.com/data"',
        "trainer.max_steps=3",
        "trainer.log_every_n_steps=1",
        "callbacks.checkpoint.every_n_steps=3",
        *QUIET,
        "run.dir=search",
    ]
    result = subprocess.run(
        [str(FW), *args], cwd=workdir, env=env, capture_output=True, text=True, timeout=300
    )
    console = result.stdout + result.stderr
    assert result.returncode == 0, console[-3000:]
    sweep, trial = workdir / "search", workdir / "search" / "0"
    assert "Best: trial 0" in console and "+extra.api_token=***" in console
    assert (trial / "checkpoints" / "step00000003" / "meta.json").is_file()
    assert "mirror: https://fw:***@example.com/data" in (trial / "config.yaml").read_text()
    assert "storage: sqlite:///" in (trial / "config.yaml").read_text(), "pruning's storage"

    for secret in SECRETS:
        assert secret not in console, secret
    files = [p for p in workdir.rglob("*") if p.is_file() and not p.is_symlink()]
    assert {"optuna.db", "train.log", "config.yaml", "meta.json", "summary.txt"} <= {
        p.name for p in files
    }
    for path in files:
        data = path.read_bytes()
        for secret in SECRETS:
            assert secret.encode() not in data, (secret, path)

    mask = umask()
    for directory in (sweep, trial, trial / "checkpoints", trial / "checkpoints" / "step00000003"):
        assert directory.stat().st_mode & 0o777 == 0o750 & ~mask, directory
    for path in files:
        if path.parent.name != "wandb" and not path.name.startswith("stacks"):
            assert path.stat().st_mode & 0o777 == 0o640 & ~mask, path


def test_a_run_dir_mode_is_configurable_and_checked(workdir, monkeypatch, capsys):
    from tests.conftest import refused

    line = refused(["run.dir_mode=0644"], workdir, monkeypatch, capsys)
    assert "run.dir_mode=0644: not a valid choice" in line and "0750" in line


def test_run_dir_mode_sets_the_run_directory_mode(workdir, monkeypatch):
    from framework.runner import make_jobs, write_config

    monkeypatch.chdir(workdir)
    job = make_jobs(["run.dir=run", "run.dir_mode=0700"])[0]
    write_config(job)
    mask = umask()
    assert (workdir / "run").stat().st_mode & 0o777 == 0o700 & ~mask
    for name in ("config.yaml", "run.json"):
        assert (workdir / "run" / name).stat().st_mode & 0o777 == 0o640 & ~mask, name


class LeakyDigits(DigitsTask):
    """Raises, on the last rank at step 1, an exception whose message holds its token and the
    environment's HF_TOKEN, as a task that reports a failed login would."""

    def __init__(self, api_token: str, hidden: int = 16) -> None:
        super().__init__(hidden=hidden)
        self.api_token = api_token

    def training_step(self, batch, batch_idx):
        if self.global_step == 1 and self.global_rank == self.trainer.world_size - 1:
            raise RuntimeError(f"the hub refused {self.api_token} ({os.environ['HF_TOKEN']})")
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("devices", [1, 2])
def test_a_task_exception_holding_a_secret_is_shown_without_it(devices, workdir):
    """One process: the traceback `fw` prints; two: torch elastic's log of the worker's failure,
    the failure `fw` reports, and the restart's cause kept in run.json."""
    env = fw_env()
    env["HF_TOKEN"] = FROM_ENV
    args = [
        "train",
        "task._target_=tests.distributed.test_leaks.LeakyDigits",
        "~task.model.dropout",
        f"+task.model.api_token={SHORT}",
        f"trainer.devices={devices}",
        "trainer.max_steps=4",
        f"launcher.max_restarts={devices - 1}",
        *QUIET,
        "run.dir=run",
    ]
    result = subprocess.run(
        [str(FW), *args], cwd=workdir, env=env, capture_output=True, text=True, timeout=300
    )
    console = result.stdout + result.stderr
    assert result.returncode == 1, console[-3000:]
    assert "RuntimeError: the hub refused *** (***)" in console, console[-3000:]
    for secret in (SHORT, FROM_ENV):
        assert secret not in console, console[-3000:]
    for path in (p for p in (workdir / "run").rglob("*") if p.is_file()):
        for secret in (SHORT, FROM_ENV):
            assert secret.encode() not in path.read_bytes(), (secret, path)
    if devices > 1:
        (restart,) = json.loads((workdir / "run" / "run.json").read_text())["restarts"]
        assert "the hub refused *** (***)" in restart["cause"], restart
