"""`strategy=ddp` through `fw`: 2 processes match 1, one run dir per job, failures end the job."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tests.conftest import FW, QUIET, fw, fw_env, losses, tree

pytestmark = pytest.mark.slow
DETERMINISTIC = [*QUIET, "trainer.deterministic=true", "trainer.log_every_n_steps=1"]


@pytest.fixture(scope="module")
def two(tmp_path_factory) -> Path:
    """digits on 2 processes of batch 16 (the one-process digits run's global batch of 32), 20
    steps, started in an empty directory: `<root>/run`."""
    root = tmp_path_factory.mktemp("two")
    two = fw(
        "train",
        "task.data.batch_size=16",
        "trainer.devices=2",
        "trainer.max_steps=20",
        *DETERMINISTIC,
        "run.dir=run",
        cwd=root,
    )
    assert two.returncode == 0, two.stderr[-3000:]
    return root


def test_two_processes_reproduce_one_process_with_the_global_batch(one_process, two):
    """Against the one-process digits run with batch 32 (tests/distributed/conftest.py)."""
    a, b = one_process["digits"], losses(two / "run")
    assert sorted(a) == list(range(20)) and sorted(b) == list(range(20))
    for step in range(20):
        assert abs(a[step] - b[step]) <= 1e-5, (step, a[step], b[step])
    assert a[19] < a[0] - 0.5, "the model learns"


def test_ddp_job_makes_one_run_dir_and_nothing_else(two):
    files = tree(two)
    assert {p.split("/")[0] for p in files} == {"run"}
    assert sum(p.endswith("config.yaml") for p in files) == 1
    assert {
        "run/config.yaml",
        "run/metrics.csv",
        "run/run.json",
        "run/checkpoints/step00000020/state.ckpt",
        "run/checkpoints/last",
    } <= files
    cfg = (two / "run" / "config.yaml").read_text()
    assert "${" not in cfg and f"dir: {two}/run" in cfg, "config.yaml is resolved, run.dir absolute"


def test_multirun_gives_independent_jobs(workdir):
    result = fw(
        "train", "-m", "seed=1,2", "trainer.devices=2", "trainer.max_steps=4", *QUIET, cwd=workdir
    )
    assert result.returncode == 0, result.stderr[-3000:]
    configs = sorted(p for p in tree(workdir) if p.endswith("config.yaml"))
    assert (
        len(configs) == 2
        and configs[0].endswith("/0/config.yaml")
        and configs[1].endswith("/1/config.yaml")
    )
    assert {p.split("/")[0] for p in tree(workdir)} == {"runs"}
    seeds = sorted(yaml.safe_load((workdir / c).read_text())["seed"] for c in configs)
    assert seeds == [1, 2]
    weights = [
        torch.load(
            workdir / c.replace("config.yaml", "checkpoints/last/state.ckpt"), weights_only=True
        )
        for c in configs
    ]
    w0, w1 = (w["state_dict"]["net.0.weight"] for w in weights)
    assert not torch.equal(w0, w1), "different seeds give different models"


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_failing_rank_ends_the_job_and_is_named(method, workdir):
    # 400 steps would take minutes: the subprocess timeout fails the test if the job lingers
    result = fw(
        "train",
        "task._target_=tests.tasks.FailingDigitsTask",
        "~task.model.dropout",
        "task.model.hidden=16",
        "trainer.devices=2",
        f"launcher.start_method={method}",
        "trainer.max_steps=400",
        *QUIET,
        f"run.dir={workdir}/run",
        cwd=workdir,
        timeout=120,
    )
    assert result.returncode == 1
    first = result.stderr.split("Job failed:\n")[1].splitlines()[0]
    assert first == "rank 1 failed: RuntimeError: deliberate failure at step 3", result.stderr[
        -2000:
    ]


# a plain LightningModule (and DataModule) under ddp: test_plain_lightning.py


def test_inside_torchrun_the_runner_does_not_spawn(workdir):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "--no-python",
        str(FW),
        "train",
        "trainer.devices=2",
        "trainer.max_steps=6",
        "trainer.log_every_n_steps=1",
        *QUIET,
        "run.dir=run",
    ]
    result = subprocess.run(
        cmd,
        cwd=workdir,
        env=fw_env(),
        capture_output=True,
        text=True,
        timeout=300,
        start_new_session=True,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr.count("Starting with 2 processes") == 1
    assert sum(p.endswith("config.yaml") for p in tree(workdir)) == 1
    assert sorted(losses(workdir / "run")) == list(range(6))
