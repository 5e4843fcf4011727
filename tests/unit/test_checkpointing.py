"""Checkpoint directories: atomic commit, verification, retention; config comparison; secrets."""

from __future__ import annotations

import json

from framework.checkpoint import disk
from framework.context import config_changes
from framework.secrets import redact


def make(ckpt_dir, step, metric=None):
    tmp = ckpt_dir / (disk.name_for(step) + ".tmp")
    tmp.mkdir(parents=True)
    (tmp / "state.ckpt").write_bytes(bytes(range(256)) * 4)
    return disk.commit(tmp, {"step": step, "metrics": {"val/loss": metric} if metric else {}})


def test_commit_is_a_rename_and_last_points_at_the_newest(tmp_path):
    a = make(tmp_path, 10)
    b = make(tmp_path, 20)
    assert not list(tmp_path.glob("*.tmp"))
    assert (tmp_path / "last").resolve() == b.resolve()
    meta = json.loads((b / "meta.json").read_text())
    assert meta["files"]["state.ckpt"]["size"] == 1024
    assert [s for s, _ in disk.listing(tmp_path)] == [20, 10]
    assert disk.verify(a) is None


def test_incomplete_and_damaged_checkpoints_are_never_chosen(tmp_path):
    make(tmp_path, 10)
    newest = make(tmp_path, 20)
    (tmp_path / "step00000030.tmp").mkdir()  # a save that was interrupted
    (newest / "state.ckpt").write_bytes(b"x" * 1024)  # same size, other bytes
    assert "checksum" in disk.verify(newest)
    assert disk.newest_complete(tmp_path).name == "step00000010"
    disk.remove_incomplete(tmp_path)
    assert not (tmp_path / "step00000030.tmp").exists()


def test_prune_keeps_the_last_k_and_the_best(tmp_path):
    for step, loss in [(10, 0.5), (20, 0.9), (30, 0.8), (40, 0.7)]:
        make(tmp_path, step, loss)
    disk.prune(tmp_path, keep_last=2, keep_best=1, monitor="val/loss", mode="min")
    assert sorted(s for s, _ in disk.listing(tmp_path)) == [10, 30, 40]
    assert disk.best(tmp_path, "val/loss", "min").name == "step00000010"


def test_config_changes_split_breaking_from_harmless():
    old = {
        "task": {"_target_": "T", "model": {"hidden": 8}, "optimizer": {"_target_": "A", "lr": 1}},
        "trainer": {"max_steps": 10},
        "seed": 0,
    }
    new = {
        "task": {"_target_": "T", "model": {"hidden": 16}, "optimizer": {"_target_": "A", "lr": 2}},
        "trainer": {"max_steps": 20},
        "seed": 0,
    }
    breaking, harmless = config_changes(old, new)
    assert breaking == ["task.model.hidden: 8 -> 16"]
    assert harmless == ["task.optimizer.lr: 1 -> 2", "trainer.max_steps: 10 -> 20"]


def test_secret_values_are_redacted():
    cfg = {
        "logger": {"wandb": {"api_key": "abc", "project": "p"}},
        "task": {"model": {"hf_token": "t"}},
    }
    out = redact(cfg)
    assert out["logger"]["wandb"] == {"api_key": "***", "project": "p"}
    assert out["task"]["model"]["hf_token"] == "***"
