"""`logger.wandb.log_model`: which committed checkpoints become W&B artifact versions, with which
aliases and metadata; the files are copied off the training thread; a failed upload does not
stop training; `last` deletes the version it replaced once online. A stand-in W&B run records what would be logged (the real offline record
is checked in tests/distributed/test_tracking.py)."""

from __future__ import annotations

import json
import logging
import threading
from types import SimpleNamespace

import pytest
import wandb

from framework.loggers.wandb.logger import RunWandbLogger


class Logged:
    """What `run.log_artifact` returns: waits and deletes are recorded."""

    def __init__(self, artifact, aliases, events):
        self.artifact, self.aliases, self.events = artifact, aliases, events

    def wait(self):
        self.events.append(("wait", self.artifact.metadata["step"]))
        return self

    def delete(self, delete_aliases=False):
        self.events.append(("delete", self.artifact.metadata["step"]))


class FakeRun:
    def __init__(self, mode="offline", fail=None):
        self.id = "abc123"
        self.settings = SimpleNamespace(mode=mode)
        self.logged: list[Logged] = []
        self.events: list[tuple[str, int]] = []
        self.fail = fail

    def log_artifact(self, artifact, aliases):
        if self.fail is not None:
            raise self.fail
        self.logged.append(Logged(artifact, aliases, self.events))
        return self.logged[-1]


@pytest.fixture
def checkpoints(tmp_path, monkeypatch):
    """Three committed checkpoints, with a validation loss each: 0.5, 0.7, 0.3."""
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "wandb-data"))
    made = []
    for step, loss in ((4, 0.5), (8, 0.7), (12, 0.3)):
        path = tmp_path / f"step{step:08d}"
        path.mkdir()
        (path / "state.ckpt").write_bytes(bytes([step]) * 64)
        meta = {"step": step, "epoch": 0, "run_id": "abc123", "metrics": {"val/loss": loss}}
        meta.update(world_size=2, format="torch", config_hash="h", config={"secret": "x"})
        (path / "meta.json").write_text(json.dumps(meta))
        made.append((path, meta, loss))
    return made


def upload(which, checkpoints, run):
    logger = RunWandbLogger(experiment=run, log_checkpoints=which, save_dir=".", log_model=False)
    best_so_far = float("inf")
    for path, meta, loss in checkpoints:
        best = loss < best_so_far
        best_so_far = min(best_so_far, loss)
        logger.log_checkpoint(path, meta, best)
        logger.log_checkpoint(path, meta, best)  # announced twice: uploaded once
        logger.log_staged()
    logger.log_staged(wait=True)
    logger._wait_pruner()
    return [(x.artifact.metadata["step"], x.aliases) for x in run.logged]


def test_all_uploads_every_checkpoint_with_its_step_and_the_best_alias(checkpoints):
    run = FakeRun()
    assert upload("all", checkpoints, run) == [
        (4, ["latest", "step-4", "best"]),
        (8, ["latest", "step-8"]),
        (12, ["latest", "step-12", "best"]),
    ]
    artifact = run.logged[0].artifact
    assert artifact.name == "model-abc123" and artifact.type == "model"
    meta = artifact.metadata
    assert (meta["run_id"], meta["step"], meta["metrics"]) == ("abc123", 4, {"val/loss": 0.5})
    assert "config" not in meta, "the config stays in the checkpoint, not the artifact's metadata"
    assert sorted(artifact.manifest.entries) == ["meta.json", "state.ckpt"]
    assert run.events == [], "offline: nothing is waited for or deleted"


def test_best_uploads_only_new_bests(checkpoints):
    run = FakeRun()
    assert upload("best", checkpoints, run) == [
        (4, ["best", "step-4"]),
        (12, ["best", "step-12"]),
    ]


def test_last_online_deletes_the_version_it_replaced(checkpoints):
    run = FakeRun(mode="online")
    assert upload("last", checkpoints, run) == [(4, ["latest"]), (8, ["latest"]), (12, ["latest"])]
    deleted = [step for kind, step in run.events if kind == "delete"]
    assert deleted == [4, 8], "each upload's predecessor, after the new one is on the server"
    assert run.events.index(("wait", 8)) < run.events.index(("delete", 4))


def test_last_offline_keeps_every_version_for_wandb_sync(checkpoints):
    run = FakeRun(mode="offline")
    assert [s for s, _ in upload("last", checkpoints, run)] == [4, 8, 12]
    assert run.events == []


def test_none_uploads_nothing(checkpoints):
    run = FakeRun()
    assert upload("none", checkpoints, run) == []


def test_a_failed_upload_is_a_warning_not_a_crash(checkpoints, caplog):
    run = FakeRun(fail=OSError("No space left on device"))
    with caplog.at_level(logging.WARNING, logger="framework.wandb"):
        assert upload("all", checkpoints, run) == []
    assert "was not uploaded (No space left on device)" in caplog.text


def test_the_copy_runs_off_the_training_thread_and_pruning_waits_for_it(checkpoints, monkeypatch):
    release, copying = threading.Event(), threading.Event()
    add_dir = wandb.Artifact.add_dir

    def slow_add_dir(self, *args, **kwargs):  # a large checkpoint on a slow disk
        copying.set()
        release.wait(30)
        return add_dir(self, *args, **kwargs)

    monkeypatch.setattr(wandb.Artifact, "add_dir", slow_add_dir)
    run = FakeRun()
    logger = RunWandbLogger(experiment=run, log_checkpoints="all", save_dir=".", log_model=False)
    path, meta, _ = checkpoints[0]
    logger.log_checkpoint(path, meta, True)  # returns while the files are still being copied
    assert copying.wait(30)
    logger.log_staged()
    assert run.logged == [], "logged only once its files are staged"
    pruning = threading.Thread(target=logger.wait_staged)
    pruning.start()
    pruning.join(0.5)
    assert pruning.is_alive(), "pruning waits until the checkpoint is copied"
    release.set()
    pruning.join(30)
    logger.log_staged()
    assert [x.aliases for x in run.logged] == [["latest", "step-4", "best"]]


def test_best_is_judged_against_every_earlier_checkpoint_even_pruned_or_from_before_a_resume(
    tmp_path,
):
    from framework.callbacks.checkpoint.callback import Checkpointer

    ckpt_dir = tmp_path / "checkpoints"
    earlier = ckpt_dir / "step00000004"  # the job before a resume kept this one
    earlier.mkdir(parents=True)
    (earlier / "meta.json").write_text(json.dumps({"step": 4, "metrics": {"val/loss": 0.4}}))
    cfg = SimpleNamespace(monitor="val/loss", mode="min")
    checkpointer = Checkpointer(cfg, SimpleNamespace(run_dir=tmp_path))
    # this job: 0.5 (not better than 0.4), 0.3 (best), then that one is pruned, then 0.35
    assert not checkpointer._new_best(0.5, [ckpt_dir / "step00000008"])
    assert checkpointer._new_best(0.3, [ckpt_dir / "step00000012"])
    assert not checkpointer._new_best(0.35, [ckpt_dir / "step00000016"])
    assert checkpointer._new_best(0.2, [ckpt_dir / "step00000020"])
    assert not checkpointer._new_best(None, [ckpt_dir / "step00000024"]), "no value: not best"
