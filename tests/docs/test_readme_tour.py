"""The README's 5-minute tour, run as written: its files are written from its code blocks and
its commands run in order in an empty directory, with only the venv's `fw` on the PATH (no
PYTHONPATH: `fw` must find `my_tasks` in the current directory by itself). The error it shows
is the error `fw` prints."""

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
    return re.findall(rf"```{lang}\n(.*?)```", tour(), flags=re.S)


def test_the_tour_runs_as_written(tmp_path):
    for body in blocks("python") + blocks("yaml"):
        path = tmp_path / body.splitlines()[0].removeprefix("# ").strip()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(body)
    script = "set -e\n" + "".join(blocks("bash"))
    # only `fw` from the venv's bin: with all of it, DeepSpeed would build its ops here with the
    # venv's `ninja` (1.13) and everywhere else with the system's (1.11), and each switch
    # rebuilds the cached ops from scratch (about a minute)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "fw").symlink_to(Path(sys.executable).parent / "fw")
    env = fw_env()
    env.pop("PYTHONPATH")
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    result = subprocess.run(
        ["bash", "-c", script],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        start_new_session=True,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    project = tmp_path / "my_project"
    state = torch.load(project / "model.pt", weights_only=True)
    assert "model.blocks.0.attn.qkv.weight" in state, "the exported gpt run"
    runs = sorted(p.name for p in (project / "runs").iterdir())
    # linear, linear again, ddp, zero2, fsdp, llama, first, and the sweep's directory
    assert len(runs) == 8 and "first" in runs and "llama" in runs, runs
    from transformers import AutoModelForCausalLM  # the transformers Llama, exported as HF

    llama = AutoModelForCausalLM.from_pretrained(project / "llama_hf")
    assert type(llama).__name__ == "LlamaForCausalLM" and llama.config.hidden_size == 64
    sweep = [p for p in (project / "runs").iterdir() if (p / "0").is_dir()]
    assert len(sweep) == 1 and (sweep[0] / "1" / "config.yaml").is_file()
    assert "strategy:" in result.stdout and "fw train" in result.stdout  # fw config, --help


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
