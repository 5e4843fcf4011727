"""Shared test helpers: run `fw` the way a user does, read run directories."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FW = Path(sys.executable).parent / "fw"
QUIET = ["trainer.enable_progress_bar=false", "trainer.enable_model_summary=false"]


# True while a test marked `gpu` runs (set by the `pin_cpu` fixture); every other test, and the
# session fixtures that make shared reference runs, are pinned to the CPU.
GPU_TEST = False
# gpt_tiny for 10 steps, one loss a step, checkpoints at steps 5 and 10: the runs that compare an
# optimizer or a number format under each layout with one process
TEN_STEPS_OF_GPT_TINY = [
    *QUIET,
    "experiment=gpt_tiny",
    "trainer.max_steps=10",
    "trainer.deterministic=true",
    "trainer.log_every_n_steps=1",
    "trainer.val_check_interval=20",
    "task.scheduler.name=constant",
    "task.model.sample_length=0",
    "logger=[csv]",
    "callbacks.checkpoint.every_n_steps=5",
]


def device_env(env: dict[str, str], gpu: bool) -> dict[str, str]:
    """`env` for a process started by a test. Not marked `gpu`: on the CPU also on a GPU machine
    (GPUs hidden, so trainer.accelerator=auto is the CPU; DeepSpeed on its CPU accelerator), as
    the bitwise comparisons, gloo assertions and trainer.devices=2 layouts of the suite assume.
    Marked `gpu`: the GPUs as they are, and no inherited DS_ACCELERATOR=cpu."""
    env = dict(env)
    if gpu:
        if env.get("DS_ACCELERATOR") == "cpu":
            del env["DS_ACCELERATOR"]
    else:
        env.update(CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu")
    return env


def fw_env() -> dict[str, str]:
    env = device_env(dict(os.environ), GPU_TEST)
    env.update(WANDB_MODE="disabled", PYTHONPATH=str(REPO))
    env.pop("WANDB_API_KEY", None)
    for key in (
        "WANDB_SERVICE",  # a W&B service this test process started: each job starts its own
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "TORCHELASTIC_RUN_ID",
        "SLURM_NTASKS",
        "SLURM_PROCID",
    ):
        env.pop(key, None)
    return env


def fw(*args: str, cwd: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run the `fw` console script with arguments; output captured as text."""
    return subprocess.run(
        [str(FW), *args],
        cwd=cwd or REPO,
        env=fw_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        start_new_session=True,  # its own process group, as a job started from a shell
    )


def trained(*args: str, cwd: Path) -> str:
    """`fw train ARGS` in `cwd`, which must succeed; its stderr."""
    result = fw("train", *args, cwd=cwd)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stderr


def read_metrics(run_dir: Path) -> list[dict[str, str]]:
    with (Path(run_dir) / "metrics.csv").open(newline="") as fh:
        return list(csv.DictReader(fh))


def losses(run_dir: Path) -> dict[int, float]:
    """train/loss by step. A step logged twice fails here, where a dict would hide it; compare
    the steps (sorted(a) == sorted(b)) as well as the values, so a missing one fails too."""
    rows = metric_rows(run_dir)
    steps = [step for step, _ in rows]
    assert len(steps) == len(set(steps)), f"a step logged more than once in {run_dir}: {steps}"
    return {step: float(loss) for step, loss in rows}


def metric_rows(run: Path) -> list[tuple[int, str]]:
    """(step, train/loss as written) of every row, in file order: a repeated step shows twice,
    and text equality is bitwise equality."""
    return [(int(r["step"]), r["train/loss"]) for r in read_metrics(run) if r.get("train/loss")]


def assert_resumed(stderr: str, run: Path, steps: int, moved: bool = False) -> None:
    """The second leg of a run resumed from a checkpoint (not a fresh start) and every step
    0..steps-1 is logged exactly once."""
    assert "Resuming from" in stderr, stderr[-2000:]
    if moved:
        assert "Moving checkpoint" in stderr, stderr[-2000:]
    assert [s for s, _ in metric_rows(run)] == list(range(steps)), "each step exactly once"


def tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in Path(root).rglob("*")}


def pytest_configure(config) -> None:
    """One torch thread per process: this process, and every process a test starts (they
    inherit it). `make test` runs 2 pytest workers on 2 cores, each starting jobs of 1-4
    processes, and a one-process job would otherwise start a thread per core whose OpenMP
    threads spin while waiting, burning the CPU the others need: a one-process gpt_tiny run took
    21 CPU-s against 9 with one thread (load ~6; 2-process jobs already take one thread each,
    framework.worker.limit_threads). Likewise torch.compile compiles in the process that
    compiles (no pool of compile workers per rank: 40.7 against 43.0 CPU-s for a 2-process
    compiled gpt_tiny job with a cold cache, the same losses). A value set by whoever runs the
    tests wins.

    W&B is disabled in this process: a test that trains in-process (cli.main) would otherwise
    log offline and leave a W&B service whose token (WANDB_SERVICE) later jobs inherit; a test
    of W&B sets its mode itself."""
    os.environ["WANDB_MODE"] = "disabled"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    if "torch" in sys.modules:  # imported before this hook: set its pool too
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_sessionstart(session) -> None:
    """A JIT build of a DeepSpeed op killed midway (a killed job or test run) leaves its lock in
    torch's extension cache, and every later DeepSpeed job waits on it forever at "initializing
    deepspeed distributed" (ENV.md): a lock older than any build (15 min) is removed."""
    import time

    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR", Path.home() / ".cache" / "torch_extensions"))
    for lock in root.glob("*/*/lock"):
        try:
            if time.time() - lock.stat().st_mtime > 15 * 60:
                lock.unlink()
        except OSError:
            pass


def pytest_collection_modifyitems(config, items) -> None:
    """Tests marked `gpu` are skipped, with the reason, where no CUDA device is present."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (none present)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def pin_cpu(request, monkeypatch) -> None:
    """A test not marked `gpu` runs on the CPU, in this process too: GPUs hidden from what it
    starts (`device_env`), and CUDA reported absent to the framework and Lightning here."""
    gpu = request.node.get_closest_marker("gpu") is not None
    monkeypatch.setattr(sys.modules[__name__], "GPU_TEST", gpu)
    if gpu:
        if os.environ.get("DS_ACCELERATOR") == "cpu":
            monkeypatch.delenv("DS_ACCELERATOR")
        return
    import torch

    for name, value in device_env({}, gpu=False).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """An empty directory to run `fw` in (so stray outputs would show up there)."""
    d = tmp_path / "work"
    d.mkdir()
    return d


def refused(args: list[str], cwd: Path, monkeypatch, capsys) -> str:
    """`fw train ARGS` run in this process (as `fw` would, without its start-up cost): it exits
    with code 2 and one line, no traceback, nothing written in `cwd`. Returns the line."""
    from framework.cli import main

    monkeypatch.chdir(cwd)
    before = set(cwd.iterdir())
    code = main(["train", *args, "run.dir=run"])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert err.startswith("error: ") and len(err.splitlines()) == 1, err
    assert "Traceback" not in err
    assert set(cwd.iterdir()) == before, "nothing written for a refused job"
    return err
