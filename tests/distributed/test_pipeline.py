"""Pipeline parallel: every schedule reproduces one process's losses; pp x dp and pp x tp too;
GPipe holds m microbatches per stage, 1F1B at most p; kill -9 and restart is exact; a pipeline
checkpoint resumes without a pipeline and exports whole; bad splits and schedules are refused
before launch."""

from __future__ import annotations

import json

import pytest
import torch
from omegaconf import OmegaConf

from framework.config.compose import compose_config
from framework.config.validate import plan_job
from framework.errors import ConfigError
from tests.conftest import QUIET, assert_resumed, fw, losses, metric_rows, read_metrics, refused
from tests.distributed.test_resume import kill_then_restart

pytestmark = pytest.mark.slow
COMMON = [*QUIET, "trainer.deterministic=true", "trainer.log_every_n_steps=1", "logger=[csv]"]
GPT = [
    "experiment=gpt_tiny",
    "trainer.val_check_interval=20",
    "task.scheduler.name=constant",
    "callbacks.checkpoint.every_n_steps=10",
]


SHARDS = ["+callbacks.shards._target_=tests.tasks.ShardCounter", "+callbacks.shards.out=OUT"]


def train(*args: str, cwd) -> str:
    result = fw("train", *args, *COMMON, cwd=cwd)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stderr


def val_losses(run) -> list[float]:
    return [float(r["val/loss"]) for r in read_metrics(run) if r.get("val/loss")]


@pytest.fixture(scope="module")
def single(one_process):
    """One-process references: gpt_tiny with batch 8 and 16."""
    return one_process["root"]


def assert_same(run, reference) -> None:
    got, want = losses(run), losses(reference)
    assert sorted(got) == sorted(want) and len(got) == 20
    assert all(abs(got[s] - want[s]) <= 1e-5 for s in want), (got, want)
    assert val_losses(run) == pytest.approx(val_losses(reference), abs=1e-5)


def last_metrics(run) -> dict[str, float]:
    rows = [r for r in read_metrics(run) if r.get("pipeline/bubble")]
    return {k: float(v) for k, v in rows[-1].items() if k.startswith("pipeline/") and v}


@pytest.mark.parametrize(
    ("args", "reference"),
    [
        (["strategy.schedule=gpipe", "trainer.activation_checkpointing=selective"], "gpt8"),
        (["strategy.schedule=1f1b", "strategy.trace=true", "strategy.balance=time"], "gpt8"),
        (["strategy.schedule=interleaved_1f1b", "strategy.virtual_stages=2"], "gpt8"),
        (
            [
                "strategy.schedule=zero_bubble",
                "strategy.virtual_stages=2",
                "trainer.activation_checkpointing=full",
            ],
            "gpt8",
        ),
        (["strategy.schedule=zbv", "strategy.virtual_stages=2"], "gpt8"),
        (["strategy.pp=2", "strategy.dp=2", "trainer.devices=4"], "gpt16"),
        (["strategy.pp=2", "strategy.tp=2", "trainer.devices=4"], "gpt8"),
        # pp2 x fsdp2 with one stage per rank: test_moe.py's pp2xep2 (pp 2 x fsdp 2, ep within)
        (
            [
                "strategy.pp=2",
                "strategy.fsdp=2",
                "strategy.schedule=interleaved_1f1b",
                "strategy.virtual_stages=2",
                "trainer.devices=4",
                *SHARDS,
            ],
            "gpt16",
        ),
    ],
    ids=[
        "gpipe",
        "1f1b",
        "interleaved_1f1b",
        "zero_bubble",
        "zbv",
        "pp2xdp2",
        "pp2xtp2",
        "pp2xfsdp2-interleaved",
    ],
)
def test_pipeline_reproduces_one_process(args, reference, single, workdir):
    args = [a.replace("OUT", str(workdir)) for a in args]
    train("strategy=pipeline", "trainer.devices=2", *GPT, *args, "run.dir=run", cwd=workdir)
    assert_same(workdir / "run", single / reference)
    metrics = last_metrics(workdir / "run")
    assert 0.0 <= metrics["pipeline/bubble"] < 1.0
    n_stages = 4 if "strategy.virtual_stages=2" in args else 2
    assert all(metrics[f"pipeline/busy_s_stage{s}"] > 0 for s in range(n_stages))
    peaks = [metrics[f"pipeline/peak_microbatches_rank{r}"] for r in range(2)]
    if "strategy.schedule=gpipe" in args:
        assert peaks == [4, 4]  # all m=4 microbatches' activations held before any backward
    if "strategy.schedule=1f1b" in args:
        assert max(peaks) <= 2  # at most p
    if SHARDS[0] in args:  # FSDP really shards each stage: half of its weights per rank
        for rank in range(4):
            counts = json.loads((workdir / f"shards-rank{rank}.json").read_text())
            assert counts["params"] * 2 == pytest.approx(counts["full"], rel=0.02), counts
    if "strategy.trace=true" in args:
        png = workdir / "run" / "pipeline_schedule.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_pipeline_checkpoint_resumes_without_a_pipeline_and_exports_whole(single, workdir):
    train(
        "strategy=pipeline",
        "trainer.devices=2",
        *GPT,
        "trainer.max_steps=10",
        "run.dir=run",
        cwd=workdir,
    )
    from framework.cli import main  # `fw export` in this process: its start-up is paid elsewhere

    ckpt = workdir / "run" / "checkpoints" / "step00000010"
    assert main(["export", str(ckpt), str(workdir / "pp.pt")]) == 0
    ref = single / "gpt8" / "checkpoints" / "step00000010"
    assert main(["export", str(ref), str(workdir / "one.pt")]) == 0
    a = torch.load(workdir / "pp.pt", weights_only=True)
    b = torch.load(workdir / "one.pt", weights_only=True)
    assert a.keys() == b.keys() and "model.blocks.1.attn.qkv.weight" in a
    assert all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)
    err = train("strategy=ddp", "trainer.devices=1", *GPT, "run.dir=run", cwd=workdir)
    assert_resumed(err, workdir / "run", 20, moved=True)
    assert_same(workdir / "run", single / "gpt8")


def test_kill_9_then_restart_under_pp2_is_exact(workdir):
    args = [
        "task._target_=tests.tasks.SlowLossDigits",
        "+task.model.loss_sleep=0.01",
        "strategy=pipeline",
        "strategy.microbatches=2",
        "trainer.devices=2",
        "trainer.max_steps=20",
        "callbacks.checkpoint.every_n_steps=5",
        "trainer.val_check_interval=10",
        *COMMON,
    ]
    train(*args, "run.dir=reference", cwd=workdir)
    err = kill_then_restart(args, workdir / "run", 13, workdir)
    assert "Resuming from" in err
    got, want = metric_rows(workdir / "run"), metric_rows(workdir / "reference")
    assert [s for s, _ in got] == list(range(20))
    assert got == want, "losses after the restart are bitwise those of the uninterrupted run"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["strategy.microbatches=3"], "must divide the batch of each data-parallel rank"),
        (
            ["task=digits", "task._target_=tests.tasks.PlainDigits", "~task.model.dropout"],
            "defines no loss",
        ),
    ],
)
def test_invalid_pipelines_are_refused_before_launch(args, message, workdir, monkeypatch, capsys):
    base = [] if "task=digits" in args else GPT
    err = refused(
        ["strategy=pipeline", "trainer.devices=2", *base, *args], workdir, monkeypatch, capsys
    )
    assert message in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["strategy.schedule=interleaved_1f1b", "strategy.virtual_stages=3"],
            "6 stages (pp x virtual_stages) is more than the 4 layers",
        ),
        (["strategy.schedule=zero_bubble"], "needs virtual_stages >= 2"),
        (["strategy.schedule=zbv", "strategy.virtual_stages=3"], "needs virtual_stages == 2"),
        (["strategy.schedule=pipedream"], "Valid choices: gpipe, 1f1b"),
        (["strategy.balance=flops"], "Valid choices: params, time"),
        (
            [
                "strategy.schedule=zbv",
                "strategy.virtual_stages=2",
                "trainer.activation_checkpointing=selective",
            ],
            "torch's selective checkpointing allows only one",
        ),
        (["strategy.split_points=[model.blocks.7]"], "is not where a layer of GPTTask begins"),
        (["strategy.split_points=[model.blocks.0,model.ln_f]"], "2 stages need 1 split points"),
        (["strategy.pp=3"], "the degrees multiply to 3, but the job has 2"),
    ],
)
def test_invalid_splits_and_schedules_are_config_errors(args, message):
    cfg = compose_config(["strategy=pipeline", "trainer.devices=2", "experiment=gpt_tiny", *args])
    OmegaConf.resolve(cfg)
    with pytest.raises(ConfigError) as err:
        plan_job(cfg)
    assert message in str(err.value)
