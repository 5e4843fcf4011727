"""W&B's service process dying under training (SLURM's scancel signals every process of the
job) is one warning, not a crash: W&B is dropped, training and metrics.csv go on."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import wandb  # noqa: F401 (the wandb extra: missing, these fail, not skip)

from framework.loggers.wandb.logger import RunWandbLogger


class DeadService:
    """A run whose service process is gone: every record breaks the pipe to it."""

    def __init__(self) -> None:
        self.id = "abc123"
        self.settings = SimpleNamespace(mode="offline")
        self.calls = 0

    def log(self, *args, **kwargs):
        self.calls += 1
        raise BrokenPipeError(32, "Broken pipe")

    def log_artifact(self, *args, **kwargs):
        raise AssertionError("nothing is uploaded to a run that was lost")


def test_a_broken_pipe_is_one_warning_and_wandb_is_dropped(tmp_path, caplog):
    run = DeadService()
    logger = RunWandbLogger(experiment=run, log_checkpoints="all", save_dir=".", log_model=False)
    with caplog.at_level(logging.WARNING, logger="framework.wandb"):
        for step in range(3):
            logger.log_metrics({"train/loss": 1.0}, step=step)  # no exception reaches training
    warnings = [r.getMessage() for r in caplog.records if "W&B stopped logging" in r.getMessage()]
    assert warnings == [
        "W&B stopped logging (BrokenPipeError: [Errno 32] Broken pipe); training goes on"
    ]
    assert run.calls == 1, "no further record is sent to the dead service"
    ckpt = tmp_path / "step00000004"
    ckpt.mkdir()
    logger.log_checkpoint(ckpt, {"step": 4}, best=True)
    logger.log_staged(wait=True)


class Service:
    """wandb's init and teardown as the offline fallback sees them: the id of a failed online
    run stays 'in use' for the first `busy` inits."""

    def __init__(self, busy: int, error: str = "run ID abc is in use"):
        self.busy, self.error, self.inits, self.teardowns = busy, error, 0, 0

    def init(self, **kwargs):
        self.inits += 1
        if self.inits <= self.busy:
            raise RuntimeError(self.error)
        return SimpleNamespace(mode=kwargs["mode"])

    def teardown(self):
        self.teardowns += 1


def test_the_offline_fallback_waits_for_the_failed_runs_id(monkeypatch):
    from framework.loggers.wandb import logger

    monkeypatch.setattr(logger.time, "sleep", lambda s: None)
    service = Service(busy=2)
    run = logger.init_offline_after_failure(service, settings=None, args={"id": "abc"})
    assert run.mode == "offline" and service.inits == 3 and service.teardowns == 2
    # another error, or one that outlasts the retries, is raised as it is
    for service in (Service(busy=1, error="bad project"), Service(busy=99)):
        with pytest.raises(RuntimeError):
            logger.init_offline_after_failure(service, settings=None, args={"id": "abc"})
    assert service.inits == 6
