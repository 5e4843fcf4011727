"""The tutorial (docs/tutorial.md), run as written: its files are written from its code blocks
and its command blocks run in order in an empty directory, as a reader with the venv activated
runs them; then what the page tells the reader is checked: exit codes, the epochs' steps, the
resume, W&B's offline run, the evaluation's files."""

from __future__ import annotations

import re
import subprocess

import pytest

from tests.conftest import REPO, losses
from tests.docs.test_readme_tour import fenced, run_commands, write_files

pytestmark = pytest.mark.slow

PAGE = REPO / "docs" / "tutorial.md"


@pytest.fixture(scope="module")
def tutorial(tmp_path_factory):
    """The directory the tutorial ran in, and the finished process."""
    root = tmp_path_factory.mktemp("tutorial")
    text = PAGE.read_text()
    write_files(fenced(text, "python") + fenced(text, "yaml"), root)
    return root, run_commands(fenced(text, "bash"), root, timeout=600)


def test_every_command_block_is_run_but_the_install():
    """A command written in another fence would silently not be run: only the install (which
    needs the repository and the network, and made the venv these tests run in) is ```sh."""
    text = PAGE.read_text()
    langs = re.findall(r"^```(\w*)$", text, flags=re.M)
    assert set(langs) <= {"", "bash", "sh", "python", "yaml"}, langs
    install = text.split("## 1. Install", 1)[1].split("\n## ", 1)[0]
    assert fenced(text, "sh") == fenced(install, "sh") and len(fenced(install, "sh")) == 2
    assert fenced(install, "bash") == []
    # the make targets it names exist (-n: nothing is run)
    targets = sorted(set(re.findall(r"`?make (\w+)", install)))
    assert targets == ["install", "run", "test"], targets
    made = subprocess.run(["make", "-n", *targets], cwd=REPO, capture_output=True, text=True)
    assert made.returncode == 0, made.stderr


def test_the_tutorial_runs_as_written(tutorial):
    root, result = tutorial
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    shown = re.search(r"\n(error: task=circle: .*)\nexit code 2\n", PAGE.read_text())
    assert shown is not None, "the page shows the error and its exit code"
    assert shown.group(1) in result.stderr.splitlines(), "the error fw prints"
    assert "exit code 2" in result.stdout.splitlines()


def test_the_tutorials_short_runs_print_no_data_wait_or_straggler_warning(tutorial):
    """A new user's first runs (one epoch of 12-24 steps, on one and two processes): the
    loader's wait is a fixed cost of well under a millisecond a batch, and nothing straggles."""
    _, result = tutorial
    for loud in ("waits for data", "Straggler"):
        assert loud not in result.stderr + result.stdout, loud


def test_the_runs_end_at_the_steps_the_page_gives(tutorial):
    project = tutorial[0] / "my_project"
    assert (project / "runs/one/checkpoints/step00000024").is_dir(), "one epoch of 24 steps"
    assert (project / "runs/ddp/checkpoints/step00000012").is_dir(), "12 steps on two processes"
    assert {"config.yaml", "metrics.csv", "checkpoints", "run.json"} <= {
        p.name for p in (project / "runs/one").iterdir()
    }


def test_the_second_epoch_resumed_the_fsdp_run(tutorial):
    root, result = tutorial
    run = root / "my_project/runs/fsdp"
    assert re.search(
        r"Resuming from \S+/runs/fsdp/checkpoints/step00000012 \(step 12\)", result.stderr
    )
    assert "trainer.max_epochs: 1 -> 2" in result.stderr
    assert (run / "checkpoints/step00000024").is_dir()
    steps = sorted(losses(run))  # each logged step once: no step trained twice
    assert steps[0] < 12 < steps[-1] < 24, steps


def test_wandb_logged_offline_and_says_how_to_upload(tutorial):
    root, result = tutorial
    offline = list((root / "my_project/runs/wandb/wandb").glob("offline-run-*"))
    assert len(offline) == 1, offline
    assert f"upload it with: wandb sync {offline[0]}" in result.stderr


def test_the_evaluations_write_what_the_page_says(tutorial):
    root, result = tutorial
    run = root / "my_project/runs/fsdp"
    for name, metric in (("validate.csv", "val/acc"), ("test.csv", "test/acc")):
        assert metric in (run / name).read_text().splitlines()[0], name
    assert "step00000024 (step 24), ddp x 1" in result.stdout, "the resumed run, one process"
    assert sorted(p.name for p in (run / "predictions").iterdir()) == [
        "rank00000.pt",
        "rank00001.pt",
    ]
    assert "\n256 predictions\n" in result.stdout, "one prediction per validation point"
