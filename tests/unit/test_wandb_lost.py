"""W&B's service process dying under training (SLURM's scancel signals every process of the
job) is one warning, not a crash: W&B is dropped, training and metrics.csv go on."""

from __future__ import annotations

import logging
from types import SimpleNamespace

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
