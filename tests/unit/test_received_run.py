"""A run directory someone sends you is data. `fw validate|test|predict` take its model and
settings from its config.yaml, but build no class, import no plugin, run no shell line or
resolver that config names unless your own config groups or command line name the same, or you
pass --trust (framework/evaluate.py); and every read of a checkpoint refuses a link inside it,
whichever path reads it (framework/checkpoint/formats, open_checkpoint).

The crafted inputs are made here from the old-layout run kept in tests/fixtures (evaluated under
strategy=ddp, as any layout is); each would create a marker file if it ran."""

from __future__ import annotations

import contextlib
import shutil
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO

FIXTURE = REPO / "tests" / "fixtures" / "checkpoints" / "dcp"
UNDER = ["strategy=ddp", "trainer.devices=1"]  # the fixture's own strategy kind is gone


def received(tmp_path: Path, edit) -> Path:
    """A copy of the fixture run whose config.yaml `edit` changed, as someone could send it."""
    run = tmp_path / "received"
    shutil.copytree(FIXTURE, run, symlinks=True)
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    edit(cfg)
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    return run


def touch(marker: Path) -> dict:
    return {"_target_": "subprocess.Popen", "args": ["touch", str(marker)]}


def plugin_module(folder: Path, marker: Path) -> str:
    """A module that creates `marker` when imported, on the import path (as an installed
    package would be): a plugin `kind` with a dot imports the module it names."""
    (folder / "planted_plugin.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    return "planted_plugin"


PLANTED = {  # what the received config holds, the key the refusal names
    "a callback by class": (
        lambda c, m, mod: c["callbacks"].update(evil=touch(m)),
        "callbacks.evil._target_=subprocess.Popen",
    ),
    "a logger by class": (
        lambda c, m, mod: c["logger"].update(evil=touch(m)),
        "logger.evil._target_=subprocess.Popen",
    ),
    "the task's class": (
        lambda c, m, mod: c["task"].update(_target_="planted_plugin.Task"),
        "task._target_=planted_plugin.Task",
    ),
    "a plugin module": (
        lambda c, m, mod: c["callbacks"].update(evil={"kind": f"{mod}.callback"}),
        "callbacks.evil.kind=planted_plugin.callback",
    ),
    "SLURM shell lines": (
        lambda c, m, mod: c.update(launcher={"kind": "slurm", "setup": [f"touch {m}"]}),
        "launcher.setup=(1 line, not shown)",
    ),
    "a resolver": (
        lambda c, m, mod: c["task"]["model"].update(note="${oc.env:HOME}"),
        "task.model.note=${oc.env:...}",
    ),
}


@pytest.mark.parametrize("case", list(PLANTED))
def test_a_received_config_runs_no_code_in_an_evaluation(case, tmp_path, monkeypatch, capsys):
    """Exit 2 before anything is imported, built or written, one paragraph naming the key and
    how to go on; the marker never appears."""
    from framework.cli import main

    marker = tmp_path / "PWNED"
    monkeypatch.syspath_prepend(str(tmp_path))
    module = plugin_module(tmp_path, marker)
    edit, named = PLANTED[case]
    run = received(tmp_path, lambda c: edit(c, marker, module))
    out = tmp_path / "out"
    code = main(["test", str(run), f"run.dir={out}", *UNDER])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert err.startswith(f"error: {named}: the run's saved config names"), err
    assert "--trust" in err and len(err.splitlines()) == 1 and "Traceback" not in err
    assert not marker.exists() and not out.exists()
    assert "planted_plugin" not in sys.modules


def test_the_runs_own_classes_and_ones_you_name_are_used(tmp_path):
    """No refusal where the code is the user's: classes of fw's config groups, chosen or not (a
    GPT run evaluated without task=gpt), a class named again on the command line, and anything
    with --trust (the config composed, nothing built)."""
    from framework.evaluate import evaluation_config

    def saved(run: Path) -> dict:
        return yaml.safe_load((run / "config.yaml").read_text())

    cfg = evaluation_config(saved(FIXTURE), UNDER, None)
    assert cfg.task._target_ == "recipes.digits.task.DigitsTask"

    def gpt(cfg: dict) -> None:
        cfg["task"]["_target_"] = "recipes.gpt.task.GPTTask"
        cfg["task"]["data"]["_target_"] = "recipes.gpt.data.TextDataModule"

    cfg = evaluation_config(saved(received(tmp_path / "g", gpt)), UNDER, None)
    assert cfg.task._target_ == "recipes.gpt.task.GPTTask"
    marker = tmp_path / "PWNED"
    run = received(tmp_path, lambda c: c["callbacks"].update(evil=touch(marker)))
    named = "callbacks.evil._target_=subprocess.Popen"
    assert evaluation_config(saved(run), [*UNDER, named], None).callbacks.evil
    assert evaluation_config(saved(run), UNDER, None, trust=True).callbacks.evil
    assert not marker.exists()


def test_a_link_in_a_checkpoint_is_refused_on_every_read(tmp_path):
    """open_checkpoint, which every load goes through (a resume, an automatic restart, an
    elastic generation, a SLURM requeue, the loss guard's rollback, an export), refuses a link
    inside the checkpoint, trusted or not; what a link points at is never read."""
    from framework.checkpoint import formats
    from framework.checkpoint.safe import UnsafeCheckpoint

    run = tmp_path / "run"
    shutil.copytree(FIXTURE, run, symlinks=True)
    ckpt = run / "checkpoints" / "step00000010"
    with contextlib.closing(formats.open_checkpoint(ckpt)) as source:  # as it is: it reads
        assert source.model()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (ckpt / "state.ckpt" / "extra").symlink_to(elsewhere, target_is_directory=True)
    for trusted in (False, True):
        with pytest.raises(UnsafeCheckpoint, match="extra is a link"):
            formats.open_checkpoint(ckpt, trusted=trusted)
