"""`strategy=hogwild` through `fw`: one worker is plain sequential SGD bitwise, also across a
resume; two workers share one set of parameters and train the digits recipe to
0.9 validation accuracy; the shared memory is mode 0600 and gone after the run; bad input
exits 2.

With two or more workers the lock-free updates interleave in an order no run repeats, so nothing
beyond one worker is compared bitwise.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from tests.conftest import (
    FW,
    QUIET,
    assert_resumed,
    fw,
    fw_env,
    losses,
    read_metrics,
    refused,
)
from tests.unit.test_preflight import run_cli

pytestmark = pytest.mark.slow
SHM = Path("/dev/shm")
SGD = [
    *QUIET,
    "task=digits",
    "task.data.batch_size=32",
    "trainer.deterministic=true",
    "trainer.log_every_n_steps=1",
    "logger=[csv]",
    "task.optimizer._target_=torch.optim.SGD",
    "task.optimizer.lr=0.1",
    "+task.optimizer.momentum=0.9",  # optimizer state that a resume must carry
    "callbacks.checkpoint.every_n_steps=100",  # each leg's last step only
]
LEGS = [6, 12]  # a hogwild run stopped at step 6, then resumed to 12
TWO_WORKERS = [
    *QUIET,
    "experiment=digits_accuracy",
    "trainer.max_epochs=4",  # measured: 0.92-0.93 after 3-4 epochs, 0.98 after 10
    "strategy=hogwild",
    "trainer.devices=2",
    "logger=[csv]",
    "+callbacks.params._target_=tests.tasks.ParametersAtTrainEnd",
    "+callbacks.shm._target_=tests.tasks.SharedMemoryModes",  # shm-rank{r}.json
]


def train(args: list[str], run: Path, steps: int) -> str:
    result = fw("train", *args, f"trainer.max_steps={steps}", f"run.dir={run}", cwd=run.parent)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stderr


def shared_files() -> set[Path]:
    return set(SHM.glob("fw-hogwild-*"))


def test_one_worker_is_sequential_sgd_bitwise_also_across_a_resume(tmp_path):
    """Steps 0-6, then 6-12 resumed in the same run directory: every step's loss is bitwise
    that of one uninterrupted process under the default strategy (ddp)."""
    reference, log = tmp_path / "ddp", tmp_path / "ddp.log"
    with log.open("w") as stderr:
        plain = subprocess.Popen(  # alongside the legs: it shares no file with them
            [str(FW), "train", *SGD, "trainer.max_steps=12", f"run.dir={reference}"],
            cwd=tmp_path,
            env=fw_env(),
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
        run = tmp_path / "hogwild"
        for i, end in enumerate(LEGS):
            err = train([*SGD, "strategy=hogwild"], run, end)
            if i:
                assert_resumed(err, run, end)
            else:
                assert "Hogwild: 1 worker(s) update" in err, err[-2000:]
        assert plain.wait(timeout=300) == 0, log.read_text()[-3000:]
    got, want = losses(run), losses(reference)
    assert sorted(got) == list(range(12)) and got == want, (got, want)
    ckpt = run / "checkpoints" / "step00000006"
    saved = torch.load(ckpt / "state.ckpt", weights_only=True)
    assert saved["hogwild"] == {"workers": 1}
    own = torch.load(ckpt / "replicas" / "rank00000.pt", weights_only=True)
    # one worker: its own state is the average
    assert torch.equal(
        own[0]["state"][0]["momentum_buffer"],
        saved["optimizer_states"][0]["state"][0]["momentum_buffer"],
    )


def test_two_workers_share_one_model_and_reach_090_accuracy(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    orphan = SHM / f"fw-hogwild-{dead.pid}-0000test"  # as a kill -9 at the wrong moment leaves
    orphan.write_bytes(b"\0" * 64)
    before = shared_files()
    run = tmp_path / "run"
    try:
        result = fw("train", *TWO_WORKERS, f"+callbacks.params.out={tmp_path}", f"run.dir={run}")
        assert result.returncode == 0, result.stderr[-3000:]
        assert not orphan.exists(), "the dead process's file is removed at the next start"
    finally:
        orphan.unlink(missing_ok=True)
    assert not shared_files() - before, "the run's shared memory leaves no file"
    # the one file both workers map, readable and writable by the job's user only
    modes = [json.loads((run / f"shm-rank{r}.json").read_text()) for r in (0, 1)]
    assert len(modes[0]) == 1 and modes[0] == modes[1], modes
    assert list(modes[0].values()) == ["0o600"], modes
    acc = [float(r["val/acc"]) for r in read_metrics(run) if r.get("val/acc")]
    assert len(acc) == 4 and acc[-1] >= 0.9, acc
    # No gradient or parameter is ever communicated, the workers' gradients differ (their
    # momentum/Adam states do), yet both see the same parameters: they are one copy.
    seen = [torch.load(tmp_path / f"params-rank{r}.pt", weights_only=True) for r in (0, 1)]
    assert all(torch.equal(seen[0][name], seen[1][name]) for name in seen[0])
    last = sorted((run / "checkpoints").glob("step*"))[-1]
    saved = torch.load(last / "state.ckpt", weights_only=True)
    assert all(torch.equal(saved["state_dict"][name], seen[0][name]) for name in seen[0])
    # each worker wrote its own optimizer state (none gathered another's), the mean beside them
    own = [
        torch.load(last / "replicas" / f"rank{r:05d}.pt", weights_only=True)[0]["state"][0]
        for r in (0, 1)
    ]
    assert not torch.equal(own[0]["exp_avg"], own[1]["exp_avg"]), "each keeps its own optimizer"
    mean = saved["optimizer_states"][0]["state"][0]["exp_avg"]
    assert torch.allclose(mean, (own[0]["exp_avg"] + own[1]["exp_avg"]) / 2)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["trainer.num_nodes=2"],
            "trainer.num_nodes=2: strategy=hogwild shares the parameters through the memory "
            "of one machine",
        ),
        (["strategy.tp=2"], "strategy.tp=2: no such key"),
        (
            ["trainer.scale_lr=linear", "trainer.reference_batch_size=64"],
            "every update applies one worker's batch",
        ),
        (["strategy.shm_dir=/nonexistent"], "strategy.shm_dir=/nonexistent: not a writable"),
    ],
)
def test_bad_hogwild_input_exits_2_before_anything_starts(
    args, message, workdir, monkeypatch, capsys
):
    err = refused(["strategy=hogwild", "trainer.devices=2", *args], workdir, monkeypatch, capsys)
    assert message in err, err


def test_hogwild_on_cuda_exits_2(capsys, monkeypatch, tmp_path):
    """`fw check` validates for the machines the config names (here a GPU one) on any machine;
    `fw train` on a GPU machine stops at the same check."""
    monkeypatch.chdir(tmp_path)
    args = ["check", "task=digits", "strategy=hogwild", "trainer.accelerator=gpu"]
    code, _, err = run_cli(args, capsys)
    assert code == 2 and "strategy=hogwild runs on the CPU only" in err, err
    assert "CUDA tensors cannot be updated that way" in err and "Traceback" not in err
