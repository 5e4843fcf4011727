"""How the W&B logger picks its mode and run (docs/wandb.md): an API key in ~/.netrc means
online, WANDB_MODE=dryrun is offline, no wandb package is refused before launch, and a run
started in a new directory from another run's checkpoint gets a new run id."""

from __future__ import annotations

import importlib.util
import json

import pytest

from framework.loggers.wandb import Config, resolve_mode
from tests.conftest import refused


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A home directory with no ~/.netrc, and no W&B settings in the environment."""
    for key in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL", "NETRC"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    return tmp_path


def write_netrc(home) -> None:
    netrc = home / ".netrc"
    netrc.write_text("machine api.wandb.ai\n  login user\n  password 0123456789abcdef\n")
    netrc.chmod(0o600)  # Python refuses a password file others can read


def test_a_key_in_netrc_means_online_and_none_offline(home):
    assert resolve_mode(Config()) == "offline"
    write_netrc(home)
    assert resolve_mode(Config()) == "online"


def test_wandb_mode_dryrun_is_offline_and_the_config_wins(home, monkeypatch):
    write_netrc(home)  # a key: without the variable the run would be online
    monkeypatch.setenv("WANDB_MODE", "dryrun")
    assert resolve_mode(Config()) == "offline"
    assert resolve_mode(Config(mode="disabled")) == "disabled"


def test_wandb_without_its_package_is_refused_before_launch(home, monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    monkeypatch.setenv("WANDB_MODE", "offline")
    work = home / "work"
    work.mkdir()
    err = refused(["logger=[csv,wandb]"], work, monkeypatch, capsys)
    assert "the wandb package is not installed" in err and "framework[wandb]" in err


def test_a_run_started_from_another_runs_checkpoint_gets_a_new_run_id(tmp_path, monkeypatch):
    from framework.cli import main

    monkeypatch.chdir(tmp_path)
    short = ["trainer.max_steps=2", "callbacks.checkpoint.every_n_steps=2", "logger=[csv]"]
    short += ["trainer.enable_progress_bar=false", "trainer.enable_model_summary=false"]
    assert main(["train", *short, "run.dir=first"]) == 0
    ckpt = next((tmp_path / "first" / "checkpoints").glob("step*"))
    assert main(["train", *short, "trainer.max_steps=4", f"resume={ckpt}", "run.dir=second"]) == 0
    ids = [
        json.loads((tmp_path / d / "run.json").read_text())["run_id"] for d in ("first", "second")
    ]
    assert ids[0] != ids[1]
    assert (tmp_path / "second" / "checkpoints" / "step00000004").is_dir(), "it did resume"
