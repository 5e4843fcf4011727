"""`trainer.scale_lr`: the learning rate follows the global batch (data-parallel ranks x per-rank
batch x accumulation) by the linear or square-root rule; `none` leaves the run as it was.

The arithmetic and the resume behaviour are checked on plain objects here; two `fw` runs (marked
slow) check that the optimizer really steps with the scaled lr, and that a resume on two processes
moves it and says so."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import yaml
from omegaconf import OmegaConf
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler, TensorDataset

from framework.errors import ConfigError
from framework.lr_scaling import Scaling, per_rank_batch_size
from framework.plugins import load_plugin
from framework.runtime.lr_scaling import callbacks, lr_slots, set_base_lr
from framework.world import World
from tests.conftest import QUIET, fw, read_metrics, refused

CONFIGURED_LR = 1e-3


def scaling(rule: str, data_parallel: int, per_rank: int = 16, accumulation: int = 2) -> Scaling:
    return Scaling(rule, 32, data_parallel, per_rank, accumulation, warmup_steps=0)


@pytest.mark.parametrize("processes", [1, 2, 4])
def test_linear_and_sqrt_give_the_expected_lr_with_accumulation_2(processes):
    # reference 32 = one process x 16 per rank x 2 accumulated: the lr was tuned on one process
    for rule, expected in (("linear", processes), ("sqrt", math.sqrt(processes))):
        s = scaling(rule, processes)
        assert s.global_batch_size == processes * 16 * 2
        assert CONFIGURED_LR * s.factor == pytest.approx(CONFIGURED_LR * expected, rel=1e-12)


def test_the_data_parallel_degree_is_not_the_world_size():
    """Four processes: ddp reads four batches per step; tensor or pipeline ranks of one group
    share theirs. The worker hands the callback the strategy's data-parallel size."""
    world = World(world_size=4, devices=4, num_nodes=1, accelerator="cpu")
    ddp, parallel = load_plugin("strategy", "ddp", "k"), load_plugin("strategy", "parallel", "k")
    layouts = {
        "ddp": (ddp, ddp.Config(), 4),
        "tensor": (parallel, parallel.Config(tp=-1), 1),
        "fsdp_tp": (parallel, parallel.Config(fsdp=-1, tp=2), 2),
        "pipeline x fsdp": (parallel, parallel.Config(pp=2, fsdp=-1), 2),
    }
    for name, (plugin, cfg, expected) in layouts.items():
        size = plugin.data_parallel(cfg, world)[1]
        assert size == expected, name
        assert scaling("linear", size).factor == expected, name


def optimizer_and_schedule(lr: float, warmup: int = 4):
    from framework.task import schedule

    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(
        [{"params": [model.weight]}, {"params": [model.bias], "lr": lr / 10}], lr=lr
    )
    sched = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule("cosine", warmup, 20, 0.1))
    trainer = SimpleNamespace(
        optimizers=[optimizer], lr_scheduler_configs=[SimpleNamespace(scheduler=sched)]
    )
    return optimizer, sched, trainer


def scale(trainer, factor: float, configured: list[float]) -> None:
    for (group, sched, i), lr in zip(lr_slots(trainer), configured, strict=True):
        set_base_lr(group, sched, i, lr * factor)


def test_scaling_moves_the_warmup_and_the_peak_of_every_param_group():
    optimizer, sched, trainer = optimizer_and_schedule(CONFIGURED_LR)
    plain, plain_sched, _ = optimizer_and_schedule(CONFIGURED_LR)
    scale(trainer, 2.0, [CONFIGURED_LR, CONFIGURED_LR / 10])
    for _ in range(8):  # through the warm-up and into the decay
        got = [g["lr"] for g in optimizer.param_groups]
        want = [2 * g["lr"] for g in plain.param_groups]
        assert got == pytest.approx(want, rel=1e-12)
        optimizer.step(), sched.step(), plain.step(), plain_sched.step()
    assert sched.base_lrs == pytest.approx([2 * CONFIGURED_LR, 2 * CONFIGURED_LR / 10])


def test_a_resume_keeps_the_lr_bitwise_or_moves_it_to_the_new_global_batch():
    configured = [CONFIGURED_LR, CONFIGURED_LR / 10]
    optimizer, sched, trainer = optimizer_and_schedule(CONFIGURED_LR)
    scale(trainer, 2.0, configured)
    for _ in range(6):
        optimizer.step(), sched.step()
    saved = (optimizer.state_dict(), sched.state_dict())
    lrs = [g["lr"] for g in optimizer.param_groups]

    def resumed(factor: float) -> tuple[torch.optim.Optimizer, object]:
        opt, sch, tr = optimizer_and_schedule(CONFIGURED_LR)  # built from the config...
        opt.load_state_dict(saved[0]), sch.load_state_dict(saved[1])  # ...then restored
        scale(tr, factor, configured)
        return opt, sch

    same, _ = resumed(2.0)
    assert [g["lr"] for g in same.param_groups] == lrs  # bitwise: nothing to change
    doubled, doubled_sched = resumed(4.0)
    assert [g["lr"] for g in doubled.param_groups] == pytest.approx([2 * lr for lr in lrs])
    assert doubled_sched.base_lrs == pytest.approx([4 * lr for lr in configured])


def test_none_adds_no_callback():
    trainer = OmegaConf.create({"scale_lr": "none", "reference_batch_size": 64})
    assert callbacks(trainer, 4, task=None, config_path="config.yaml") == []


def test_the_per_rank_batch_is_read_from_the_train_loader():
    data = TensorDataset(torch.zeros(10, 2))
    assert per_rank_batch_size(DataLoader(data, batch_size=5), "linear") == 5
    batches = BatchSampler(SequentialSampler(data), batch_size=3, drop_last=True)
    assert per_rank_batch_size(DataLoader(data, batch_sampler=batches), "linear") == 3
    with pytest.raises(ConfigError, match="trainer.scale_lr=sqrt: the per-rank batch size"):
        per_rank_batch_size(DataLoader(data, batch_size=None), "sqrt")


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["trainer.scale_lr=cubic"],
            "trainer.scale_lr=cubic: not a valid choice. Valid choices: none, linear, sqrt.",
        ),
        (
            ["trainer.scale_lr=linear", "trainer.reference_batch_size=0"],
            "trainer.reference_batch_size=0: must be at least 1",
        ),
        (
            ["trainer.scale_lr=sqrt"],
            "trainer.reference_batch_size=None: trainer.scale_lr=sqrt needs the global batch size",
        ),
    ],
)
def test_bad_scaling_input_is_refused_before_anything_starts(
    args, message, workdir, monkeypatch, capsys
):
    assert message in refused(args, workdir, monkeypatch, capsys)


def lrs(run) -> dict[int, float]:
    return {int(r["step"]): float(r["lr-AdamW"]) for r in read_metrics(run) if r.get("lr-AdamW")}


RUN = ["logger=csv", "trainer.log_every_n_steps=1", *QUIET, "run.dir=run"]


@pytest.mark.slow
def test_none_leaves_the_optimizer_lr_untouched(workdir):
    # a reference batch alone scales nothing
    done = fw("train", "trainer.max_steps=2", "trainer.reference_batch_size=8", *RUN, cwd=workdir)
    assert done.returncode == 0, done.stderr[-3000:]
    assert set(lrs(workdir / "run").values()) == {3e-3}  # conf/task/digits.yaml's lr
    assert "lr_scaling" not in yaml.safe_load((workdir / "run" / "config.yaml").read_text())
    assert "Learning rate scaled" not in done.stderr


@pytest.mark.slow
def test_linear_scaling_reaches_the_optimizer_and_a_resume_on_two_processes_moves_it(workdir):
    # digits: 64 per rank x 2 accumulated = 128, tuned at 64 -> x2; two processes -> 256 -> x4
    scaled = ["trainer.scale_lr=linear", "trainer.reference_batch_size=64"]
    scaled += ["trainer.accumulate_grad_batches=2"]
    first = fw("train", "trainer.max_steps=2", *scaled, *RUN, cwd=workdir)
    assert first.returncode == 0, first.stderr[-3000:]
    line = "global batch 128 = 1 data-parallel x 64 per rank x 2 accumulated, reference 64"
    assert line in first.stderr and "lr x 2 (lr 0.003 -> 0.006)" in first.stderr
    assert lrs(workdir / "run") == {0: 6e-3, 1: 6e-3}
    record = yaml.safe_load((workdir / "run" / "config.yaml").read_text())["lr_scaling"]
    assert record["global_batch_size"] == 128 and record["lr"] == [6e-3]

    second = fw("train", "trainer.max_steps=4", "trainer.devices=2", *scaled, *RUN, cwd=workdir)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "trainer.devices: 1 -> 2" in second.stderr
    change = (
        "Learning-rate scaling changed on resume: global batch 128 (1 data-parallel) -> "
        "256 (2 data-parallel), lr 0.006 -> 0.012"
    )
    assert change in second.stderr, second.stderr[-3000:]
    assert lrs(workdir / "run") == {0: 6e-3, 1: 6e-3, 2: 1.2e-2, 3: 1.2e-2}
    record = yaml.safe_load((workdir / "run" / "config.yaml").read_text())["lr_scaling"]
    assert record["data_parallel"] == 2 and record["factor"] == 4.0
