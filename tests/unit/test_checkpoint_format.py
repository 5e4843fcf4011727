"""A checkpoint format is one object in one file (framework/checkpoint/formats): a toy format,
written here in a few lines, is read by a resume (moved into the ddp layout) and by `fw export`
exactly as the format it was converted from; one nobody registered is refused before launch."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from framework.checkpoint import disk, formats, safe
from framework.checkpoint.load import read_whole
from framework.checkpoint.portable import MODEL, OptimizerSpec, Read, TensorSpec
from tests.conftest import QUIET, losses

TASK = ["task=digits", "task.model.hidden=16", "logger=[csv]", "trainer.log_every_n_steps=1"]
TASK += ["callbacks.checkpoint.every_n_steps=2", "trainer.deterministic=true", *QUIET]


class ToySource:
    """The toy layout: one torch file, `{"model": {name: tensor}, "state": [{name: {entry:
    value}}], "groups": [...], "rest": {...}}`."""

    def __init__(self, path: Path, trusted: bool = False) -> None:
        self.data = safe.load_torch(path / "toy.pt", "toy.pt", trusted=trusted)

    def model(self):
        return {n: TensorSpec(tuple(t.shape), t.dtype) for n, t in self.data["model"].items()}

    def optimizers(self):
        specs = []
        for groups, state in zip(self.data["groups"], self.data["state"], strict=True):
            entries = {
                name: {
                    k: TensorSpec(tuple(v.shape), v.dtype) if torch.is_tensor(v) else v
                    for k, v in e.items()
                }
                for name, e in state.items()
            }
            specs.append(OptimizerSpec(groups, entries))
        return specs

    def read(self, requests: list[Read]) -> None:
        for r in requests:
            saved = (
                self.data["model"][r.key[1]]
                if r.key[0] == MODEL
                else self.data["state"][r.key[1]][r.key[2]][r.key[3]]
            )
            for d, (o, n) in enumerate(zip(r.offset, r.out.shape, strict=True)):
                saved = saved.narrow(d, o, n)
            r.out.copy_(saved)

    def rest(self):
        return dict(self.data["rest"])

    def largest_read(self) -> int:
        return 0

    def close(self) -> None:
        pass


class ToyFormat:
    name = "toy"
    any_world = False
    state = "state.ckpt"
    allowed = ()

    def movable(self, meta):
        return None

    def open(self, path: Path, trusted: bool = False) -> ToySource:
        return ToySource(path, trusted)


def to_toy(ckpt: Path) -> None:
    """Rewrite a committed checkpoint in the toy layout (and commit it as the framework does)."""
    whole = read_whole(ckpt)
    meta = disk.read_meta(ckpt)
    meta.pop("files")
    tmp = ckpt.with_name(ckpt.name + ".tmp")
    tmp.mkdir()
    (tmp / "state.ckpt").mkdir()
    data = {
        "model": whole.model,
        "state": [o["state"] for o in whole.optimizers],
        "groups": [o["groups"] for o in whole.optimizers],
        "rest": whole.rest,
    }
    torch.save(data, tmp / "state.ckpt" / "toy.pt")
    shutil.rmtree(ckpt)
    disk.commit(tmp, {**meta, "format": "toy"})


@pytest.fixture
def toy_registered(monkeypatch):
    monkeypatch.setattr(formats, "_registered", {})
    formats.register(ToyFormat())


def test_a_format_in_one_file_is_resumed_and_exported(tmp_path, monkeypatch, toy_registered):
    from framework.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["train", *TASK, "trainer.max_steps=2", "run.dir=plain"]) == 0
    shutil.copytree("plain", "toy", symlinks=True)
    to_toy(tmp_path / "toy" / "checkpoints" / "step00000002")
    assert (
        json.loads((tmp_path / "toy/checkpoints/step00000002/meta.json").read_text())["format"]
        == "toy"
    )
    for run in ("plain", "toy"):  # the toy checkpoint resumes exactly as the one it came from
        assert main(["train", *TASK, "trainer.max_steps=4", f"run.dir={run}"]) == 0
    assert losses(tmp_path / "toy") == losses(tmp_path / "plain")
    assert sorted(losses(tmp_path / "toy")) == [0, 1, 2, 3]
    # fw export reads it through its Source, as any format
    assert main(["export", "toy/checkpoints/step00000002", "toy.pt"]) == 0
    assert main(["export", "plain/checkpoints/step00000002", "plain.pt"]) == 0
    toy, plain = (torch.load(f, weights_only=True) for f in ("toy.pt", "plain.pt"))
    assert toy.keys() == plain.keys() and all(torch.equal(toy[k], plain[k]) for k in plain)


def test_a_format_nobody_registered_is_refused_before_launch(tmp_path, monkeypatch, capsys):
    from framework.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(formats, "_registered", {})
    formats.register(ToyFormat())
    assert main(["train", *TASK, "trainer.max_steps=2", "run.dir=run"]) == 0
    to_toy(tmp_path / "run" / "checkpoints" / "step00000002")
    monkeypatch.setattr(formats, "_registered", {})
    capsys.readouterr()
    assert main(["train", *TASK, "trainer.max_steps=4", "run.dir=run"]) == 2
    err = capsys.readouterr().err
    assert "checkpoint format 'toy' is not known" in err and "lightning" in err, err
