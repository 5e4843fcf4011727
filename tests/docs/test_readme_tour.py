"""The README's 5-minute tour, run as written: its files are written from its code blocks and
its commands run in order in an empty directory, with only the venv's `fw` and `python` on the
PATH (no PYTHONPATH: `fw` must find `my_tasks` in the current directory by itself). The error it
shows is the error `fw` prints. The tutorial (docs/tutorial.md) is run by the same helpers."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, fw_env

pytestmark = pytest.mark.slow


def tour() -> str:
    text = (REPO / "README.md").read_text()
    return text.split("## A 5-minute tour", 1)[1].split("\n## ", 1)[0]


def blocks(lang: str) -> list[str]:
    return fenced(tour(), lang)


def fenced(text: str, lang: str) -> list[str]:
    """The bodies of the page's ```LANG blocks, in order."""
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def write_files(bodies: list[str], root: Path) -> None:
    """Each code block whose first line is `# PATH` becomes the file PATH under `root`."""
    for body in bodies:
        path = root / body.splitlines()[0].removeprefix("# ").strip()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(body)


def run_commands(commands: list[str], cwd: Path, timeout: float = 900):
    """The command blocks run in order as one bash script (`set -e`: the first failure stops it)
    in `cwd`, as a reader runs them in a shell with the venv activated."""
    # only `fw` and `python` from the venv's bin: with all of it, DeepSpeed would build its ops
    # here with the venv's `ninja` (1.13) and everywhere else with the system's (1.11), and each
    # switch rebuilds the cached ops from scratch (about a minute)
    bin_dir = cwd / "bin"
    bin_dir.mkdir()
    (bin_dir / "fw").symlink_to(Path(sys.executable).parent / "fw")
    (bin_dir / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (bin_dir / "python").chmod(0o755)
    env = fw_env()
    env.pop("PYTHONPATH")  # `fw` must find the reader's modules in the current directory itself
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    return subprocess.run(
        ["bash", "-c", "set -e\n" + "".join(commands)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        start_new_session=True,
    )


def test_the_tour_runs_as_written(tmp_path):
    write_files(blocks("python") + blocks("yaml"), tmp_path)
    result = run_commands(blocks("bash"), tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    project = tmp_path / "my_project"
    runs = sorted(p.name for p in (project / "runs").iterdir())
    assert len(runs) == 3 and "first" in runs, runs  # two dated directories, and first
    assert "test/acc" in (project / "runs/first/test.csv").read_text().splitlines()[0]
    state = torch.load(project / "model.pt", weights_only=True)
    assert sorted(state) == ["net.bias", "net.weight"], "the fsdp run, exported whole"
    assert state["net.weight"].shape == (10, 64)
    assert "strategy:" in result.stdout  # fw config


def test_the_error_the_tour_shows_is_the_one_fw_prints(tmp_path):
    shown = re.search(r"\$ (fw train .*)\n(error: .*)\n", tour())
    assert shown is not None
    result = subprocess.run(
        [str(Path(sys.executable).parent / "fw"), *shown.group(1).split()[1:]],
        cwd=tmp_path,
        env=fw_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert result.stderr.strip() == shown.group(2)
