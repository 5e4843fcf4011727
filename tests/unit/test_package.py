"""Importing the package is cheap; TaskModule takes its optimizer and schedule from the config."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch


def test_import_framework_pulls_no_heavy_optional_parts(tmp_path):
    """Importing the package, and `fw train` refusing a bad choice (what a typo costs), load
    neither the optional parts nor torch (about 2 s of CPU) nor Lightning (about 7 s)."""
    code = (
        "import sys, framework, framework.cli, framework.runner;"
        "code = framework.cli.main(['train', 'strategy=nope', 'run.dir=run']);"
        "bad=[m for m in ('deepspeed','wandb','lightning','torch') if m in sys.modules];"
        "print(code, ','.join(bad))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path
    )
    assert out.stdout.strip() == "2", out.stdout + out.stderr[-2000:]
    assert "strategy=nope: no such option" in out.stderr


def test_task_module_builds_optimizer_and_schedule_from_config():
    from framework.task import schedule
    from recipes.digits.task import DigitsTask

    task = DigitsTask(hidden=8)
    task.configure_from(
        {"_target_": "torch.optim.SGD", "lr": 0.5, "momentum": 0.9}, {"name": "constant"}
    )
    opt = task.configure_optimizers()
    assert isinstance(opt, torch.optim.SGD)
    assert opt.defaults["lr"] == 0.5 and opt.defaults["momentum"] == 0.9
    f = schedule("cosine", warmup=10, total=110, min_ratio=0.1)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(10) == pytest.approx(1.0) and f(110) == pytest.approx(0.1)
    g = schedule("linear", warmup=0, total=100, min_ratio=0.0)
    assert g(50) == pytest.approx(0.5)
