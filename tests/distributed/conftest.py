"""One-process reference runs shared by every distributed test module (built once per session)."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import QUIET, REPO, fw, fw_env, losses

REFERENCE = [
    *QUIET,
    "trainer.deterministic=true",
    "trainer.log_every_n_steps=1",
    "logger=[csv]",
    "strategy=ddp",
    "trainer.devices=1",
]
GPT = [
    "experiment=gpt_tiny",
    "trainer.val_check_interval=20",
    "task.scheduler.name=constant",
    "callbacks.checkpoint.every_n_steps=10",
]
RUNS = {
    "gpt8": [*GPT, "task.data.batch_size=8"],
    "gpt16": [*GPT, "task.data.batch_size=16"],
    "digits": [
        "task=digits",
        "trainer.max_steps=20",
        "task.data.batch_size=32",
        "callbacks.checkpoint.every_n_steps=10",
    ],
}


def shared_root(tmp_path_factory, name: str) -> Path:
    """A directory of this test session's, the same for every pytest-xdist worker (`make test`)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = tmp_path_factory.getbasetemp().parent / name  # this session's, shared
    else:
        root = tmp_path_factory.mktemp(name)
    root.mkdir(exist_ok=True)
    return root


@pytest.fixture(scope="session")
def one_process(tmp_path_factory):
    """Run directories of one-process runs: gpt_tiny with batch 8 and 16 (20 steps, checkpoints
    at 10 and 20, validation at 20) and digits with batch 32 (20 steps, checkpoints at 10 and
    20: test_resume.py damages the newest); with
    `losses` of each. The workers of `make test` share them: the first to get here runs them."""
    root = shared_root(tmp_path_factory, "one_process")
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the other workers wait for the runs
        if not (root / ".done").exists():
            for name, args in RUNS.items():
                result = fw("train", *REFERENCE, *args, f"run.dir={root / name}", cwd=root)
                assert result.returncode == 0, result.stderr[-3000:]
            (root / ".done").touch()
    return {"root": root, **{name: losses(root / name) for name in RUNS}}


# the gpt recipe's corpus as test_prepared.py and test_prepare_ray.py prepare it
CORPUS = ["task=gpt", "task.data.max_bytes=1500000", "task.data.chunk_bytes=60000"]


@pytest.fixture(scope="session")
def prepared_corpus(tmp_path_factory) -> Path:
    """CORPUS prepared without interruption by `fw prepare --workers 2` (the local engine),
    once per session: what a rerun or another engine must write byte for byte. Read only."""
    root = shared_root(tmp_path_factory, "prepared_corpus")
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (root / ".done").exists():
            args = ["prepare", "--workers", "2", *CORPUS, f"task.data.prepared={root / 'data'}"]
            result = fw(*args, cwd=root)
            assert result.returncode == 0, result.stderr[-3000:]
            (root / ".done").touch()
    return root / "data"


def torchrun_script(name: str, out: Path) -> list[dict]:
    """Run tests/distributed/scripts/`name` as torch's launcher runs a user's script (2 processes,
    `out` its argument); returns what each rank wrote to out/rank<R>.json."""
    script = REPO / "tests" / "distributed" / "scripts" / name
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    result = subprocess.run(
        [*launch, str(script), str(out)], env=fw_env(), capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]
