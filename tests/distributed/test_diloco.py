"""`strategy=diloco|localsgd` through `fw` on 2 processes: local SGD with one step per round is
ddp; DiLoCo every 4 steps trains the gpt recipe as well as ddp with a quarter of the bytes;
kill -9 mid-round resumes bitwise; checkpoints move between ddp and diloco; bad input exits 2.

The identity with ddp holds for inner optimizers linear in the gradient (SGD, with momentum and
weight decay): the mean of the processes' parameters after one local step is ddp's step. It
does not hold for Adam, whose update is not linear in the gradient.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch

from tests.conftest import QUIET, assert_resumed, fw, losses, metric_rows, read_metrics, refused
from tests.distributed.conftest import GPT, REFERENCE
from tests.distributed.test_resume import start, wait_for_step

pytestmark = pytest.mark.slow
STEPS = 12  # digits runs; checkpoints every LEG steps
LEG = 3
SGD = [
    *QUIET,
    "task=digits",
    "trainer.devices=2",
    "task.data.batch_size=32",
    "trainer.deterministic=true",
    "trainer.log_every_n_steps=1",
    "logger=[csv]",
    "task.optimizer._target_=torch.optim.SGD",
    "task.optimizer.lr=0.1",  # weight decay 0.01 from the recipe: linear too
    f"callbacks.checkpoint.every_n_steps={LEG}",
    f"callbacks.checkpoint.keep_last={STEPS}",
]
MOMENTUM = "+task.optimizer.momentum=0.9"
AVERAGE_EVERY_STEP = ["strategy=localsgd", "strategy.sync_every=1"]
DILOCO_GPT = [
    # the one-process gpt16 reference's settings, on 2 processes of batch 8
    *(a for a in REFERENCE if not a.startswith(("strategy=", "trainer.devices="))),
    *GPT,
    "strategy=diloco",
    "strategy.sync_every=4",
    "trainer.devices=2",
    "task.data.batch_size=8",
]


def train(args: list[str], run, steps: int = STEPS) -> str:
    result = fw("train", *args, f"trainer.max_steps={steps}", f"run.dir={run}", cwd=run.parent)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stderr


def weights(run, step: int) -> dict[str, torch.Tensor]:
    path = run / "checkpoints" / f"step{step:08d}" / "state.ckpt"
    return torch.load(path, weights_only=True)["state_dict"]


def assert_like_ddp(run, reference, tol: float = 1e-6) -> None:
    """Every step's loss and the parameters at every checkpoint within `tol` of ddp's."""
    got, want = losses(run), losses(reference)
    assert sorted(got) == list(range(STEPS)), got
    for step in range(STEPS):
        assert abs(got[step] - want[step]) <= tol, (step, got[step], want[step])
    for step in range(LEG, STEPS + 1, LEG):
        a, b = weights(run, step), weights(reference, step)
        assert a.keys() == b.keys()
        for name in a:
            assert torch.allclose(a[name], b[name], rtol=0, atol=tol), (step, name)


@pytest.fixture(scope="module")
def ddp_sgd(tmp_path_factory):
    """ddp references with inner SGD: without and with momentum."""
    root = tmp_path_factory.mktemp("ddp_sgd")
    train([*SGD, "strategy=ddp"], root / "plain")
    train([*SGD, MOMENTUM, "strategy=ddp"], root / "momentum")
    return root


@pytest.fixture(scope="module")
def gpt_diloco(tmp_path_factory):
    """gpt_tiny, 20 steps, DiLoCo every 4 steps (inner AdamW): checkpoints at 10 (mid-round)
    and 20, validation at 20."""
    run = tmp_path_factory.mktemp("gpt_diloco") / "run"
    result = fw("train", *DILOCO_GPT, f"run.dir={run}", cwd=run.parent)
    assert result.returncode == 0, result.stderr[-3000:]
    return run


def test_diloco_with_one_step_rounds_and_outer_lr_1_is_ddp(ddp_sgd, tmp_path):
    plain_averaging = [
        "strategy=diloco",
        "strategy.sync_every=1",
        "strategy.outer_optimizer.lr=1",
        "strategy.outer_optimizer.momentum=0",
        "strategy.outer_optimizer.nesterov=false",
    ]
    train([*SGD, *plain_averaging], tmp_path / "run")
    assert_like_ddp(tmp_path / "run", ddp_sgd / "plain")


def test_moves_between_ddp_and_localsgd_continue_ddp_with_momentum(ddp_sgd, tmp_path):
    """ddp for 3 steps, localsgd for 6, ddp for 3, in one run directory, with inner SGD with
    momentum: the processes' momentum buffers differ, yet the run is the ddp run. So a ddp
    checkpoint's optimizer state seeds every process, and a localsgd checkpoint holds each
    process's own buffer and, for ddp, their mean."""
    run = tmp_path / "run"
    for i, (leg, end) in enumerate([(["strategy=ddp"], 3), (AVERAGE_EVERY_STEP, 9)]):
        err = train([*SGD, MOMENTUM, *leg], run, steps=end)
        if i:
            assert_resumed(err, run, end)
    ckpt = run / "checkpoints" / "step00000009"
    saved = torch.load(ckpt / "state.ckpt", weights_only=True)
    assert saved["diloco"]["replicas"] == 2
    # each process wrote its own file (no process gathered another's state)
    files = sorted((ckpt / "replicas").iterdir())
    assert [f.name for f in files] == ["rank00000.pt", "rank00001.pt"]
    replicas = [torch.load(f, weights_only=True) for f in files]
    assert all("model" not in r for r in replicas), "synchronised"
    buffers = [r["optimizers"][0]["state"][0]["momentum_buffer"] for r in replicas]
    assert not torch.equal(*buffers), "each process keeps its own inner state"
    mean = saved["optimizer_states"][0]["state"][0]["momentum_buffer"]
    assert torch.allclose(mean, (buffers[0] + buffers[1]) / 2)
    assert_resumed(train([*SGD, MOMENTUM, "strategy=ddp"], run), run, STEPS)
    assert_like_ddp(run, ddp_sgd / "momentum")


def test_diloco_every_4_steps_trains_gpt_as_ddp_with_a_quarter_of_the_bytes(
    gpt_diloco, one_process
):
    rows = read_metrics(gpt_diloco)
    ddp_rows = read_metrics(one_process["root"] / "gpt16")  # = ddp on 2 processes of batch 8
    val = [float(r["val/loss"]) for r in rows if r.get("val/loss")]
    ddp_val = [float(r["val/loss"]) for r in ddp_rows if r.get("val/loss")]
    # Measured: 3.06 vs 3.75 (the outer Nesterov step speeds the first steps up). Stated
    # tolerance: no more than 5% above ddp's.
    assert len(val) == len(ddp_val) == 1 and val[0] <= 1.05 * ddp_val[0], (val, ddp_val)
    sent = {float(r["comm/bytes_per_step"]) for r in rows if r.get("comm/bytes_per_step")}
    ddp = {float(r["comm/ddp_bytes_per_step"]) for r in rows if r.get("comm/ddp_bytes_per_step")}
    assert len(sent) == len(ddp) == 1 and ddp.pop() / sent.pop() == 4
    synced = [int(r["step"]) for r in rows if r.get("diloco/pseudo_grad_norm")]
    assert synced == [3, 7, 11, 15, 19], "one outer step every 4 steps"
    loss = losses(gpt_diloco)  # inner AdamW: no identity with ddp, but it learns
    assert loss[19] < loss[0] - 1.0, loss


def test_kill_9_mid_round_then_restart_is_bitwise_the_uninterrupted_run(gpt_diloco, tmp_path):
    run = tmp_path / "run"
    proc = start([*DILOCO_GPT, f"run.dir={run}"], tmp_path)
    wait_for_step(run, 14, proc)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    again = fw("train", *DILOCO_GPT, f"run.dir={run}", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "Resuming from" in again.stderr and "step00000010" in again.stderr, "mid-round"
    assert metric_rows(run) == metric_rows(gpt_diloco), "bitwise the same losses"
    a, b = weights(run, 20), weights(gpt_diloco, 20)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["strategy.sync_every=0"], "strategy.sync_every=0: must be at least 1"),
        (["strategy.outer_optimizer.name=adam"], "not a valid choice. Valid choices: sgd"),
        (["strategy.tp=2"], "strategy.tp=2: no such key"),
        (["strategy.fragments=8", "strategy.sync_every=4"], "more fragments than steps"),
        (["strategy.outer_optimizer.momentum=0"], "Nesterov momentum needs"),
    ],
)
def test_bad_diloco_input_exits_2_before_anything_starts(
    args, message, workdir, monkeypatch, capsys
):
    err = refused(["strategy=diloco", "trainer.devices=2", *args], workdir, monkeypatch, capsys)
    assert message in err, err
