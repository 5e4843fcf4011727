"""Tensor parallel and N-D meshes: strategy=tensor, fsdp_tp and explicit degrees reproduce one
process; each transformer block costs exactly 2 all-reduces forward and 2 backward; a custom
model with a plan from the config; layout-changing resume; invalid degrees refused before launch."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.conftest import QUIET, assert_resumed, fw, losses, read_metrics, refused

pytestmark = pytest.mark.slow
COMMON = [
    *QUIET,
    "trainer.deterministic=true",
    "trainer.log_every_n_steps=1",
    "logger=[csv]",
]
GPT = ["experiment=gpt_tiny", "trainer.val_check_interval=20", "task.scheduler.name=constant"]
DIGITS = ["task=digits", "trainer.max_steps=20"]


def train(*args: str, cwd) -> str:
    result = fw("train", *args, *COMMON, cwd=cwd)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stderr


@pytest.fixture(scope="module")
def single(one_process):
    """One-process references: gpt_tiny with global batch 8 and 16, digits with 32."""
    return one_process


def assert_same(run, want) -> None:
    got = losses(run)
    assert sorted(got) == sorted(want) and len(got) == 20
    assert all(abs(got[s] - want[s]) <= 1e-5 for s in want), (got, want)


@pytest.mark.parametrize(
    ("args", "reference"),
    [
        (["strategy=tensor", "trainer.devices=2", "task.data.batch_size=8"], "gpt8"),
        # plain fsdp2xtp2 and dp2xtp2: covered by their -sp and -ac variants below
        (
            ["strategy=tensor", "strategy.sequence_parallel=true", "trainer.devices=2"],
            "gpt8",
        ),
        (
            ["strategy=fsdp_tp", "strategy.sequence_parallel=true", "trainer.devices=4"],
            "gpt16",
        ),
        (["strategy=tensor", "strategy.loss_parallel=false", "trainer.devices=2"], "gpt8"),
        (
            [
                "strategy=tensor",
                "strategy.dp=2",
                "strategy.tp=2",
                "strategy.sequence_parallel=true",
                "trainer.activation_checkpointing=selective",
                "trainer.devices=4",
            ],
            "gpt16",
        ),
        (
            ["strategy=fsdp_tp", "trainer.activation_checkpointing=full", "trainer.devices=4"],
            "gpt16",
        ),
    ],
    ids=[
        "tp2",
        "tp2-sp",
        "fsdp2xtp2-sp",
        "tp2-gathered-logits",
        "dp2xtp2-sp-selective-ac",
        "fsdp2xtp2-full-ac",
    ],
)
def test_tensor_parallel_layouts_reproduce_one_process_on_gpt(args, reference, single, workdir):
    speed = ["+callbacks.throughput.kind=throughput"]
    train(*args, *GPT, "callbacks=none", *speed, "run.dir=run", cwd=workdir)
    assert_same(workdir / "run", single[reference])
    # samples per step = the global batch: tensor-parallel ranks share theirs, not add to it
    rows = [r for r in read_metrics(workdir / "run") if r.get("perf/samples_per_sec")]
    assert rows, "throughput was logged"
    for row in rows:
        ratio = float(row["perf/samples_per_sec"]) / float(row["perf/steps_per_sec"])
        assert ratio == pytest.approx(int(reference.removeprefix("gpt")))
    # counted FLOPs per device: each rank's share of the reference's batch (the recomputed
    # forward of activation checkpointing counts too, so those layouts are left out here)
    if not any("activation_checkpointing" in a for a in args):
        devices = int(next(a for a in args if a.startswith("trainer.devices=")).split("=")[1])
        (ours,), (whole,) = flops(workdir / "run"), flops(single["root"] / reference)
        assert ours == pytest.approx(whole / devices, rel=0.02)


def flops(run) -> set[float]:
    return {
        float(r["perf/flops_per_batch"]) for r in read_metrics(run) if r.get("perf/flops_per_batch")
    }


def comm_counts(workdir, *args: str) -> dict:
    counter = [
        "+callbacks.comm._target_=framework.debug.CommCounter",
        f"+callbacks.comm.out={workdir}",
    ]
    train(*args, "trainer.max_steps=3", "callbacks=none", *counter, "run.dir=run", cwd=workdir)
    return json.loads((workdir / "comm.json").read_text())


def test_each_transformer_block_costs_two_all_reduces_forward_and_two_backward(workdir):
    counts = comm_counts(workdir, "strategy=tensor", "trainer.devices=2", *GPT)
    blocks = [k for k in counts if k.startswith("GPTTask.model.blocks.") and k.count(".") == 3]
    assert len(blocks) == 2  # gpt_tiny has 2 layers
    for block in blocks:
        assert counts[block] == {"forward": {"all_reduce": 2}, "backward": {"all_reduce": 2}}
    # vocabulary-parallel embedding: one all-reduce; the logits stay split over the vocabulary
    # (loss_parallel): the head gathers nothing, the loss all-reduces per-token statistics only
    assert counts["GPTTask.model.tok"]["forward"] == {"all_reduce": 1}
    assert counts["GPTTask.model.head"]["forward"] == {}
    (workdir / "comm.json").unlink()
    gathered = comm_counts(
        workdir / "run",
        "strategy=tensor",
        "strategy.loss_parallel=false",
        "trainer.devices=2",
        *GPT,
    )
    assert gathered["GPTTask.model.head"]["forward"] == {"all_gather_into_tensor": 1}


def test_sequence_parallel_blocks_all_gather_and_reduce_scatter_instead(workdir):
    sp = ["strategy=tensor", "strategy.sequence_parallel=true", "trainer.devices=2", *GPT]
    counts = comm_counts(workdir, *sp)
    same_bytes = {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2}
    for block in ("GPTTask.model.blocks.0", "GPTTask.model.blocks.1"):
        assert counts[block] == {"forward": same_bytes, "backward": same_bytes}


@pytest.mark.parametrize(
    "args",
    [
        ["strategy=ddp", "trainer.compile=true", "trainer.activation_checkpointing=full"],
        ["strategy=zero3", "trainer.activation_checkpointing=full"],
        ["strategy=fsdp", "trainer.compile=true", "trainer.activation_checkpointing=selective"],
        [
            "strategy=tensor",
            "strategy.sequence_parallel=true",
            "trainer.activation_checkpointing=full",
        ],
        ["strategy=tensor", "trainer.compile=true", "trainer.activation_checkpointing=selective"],
    ],
    ids=[
        "ddp-compile-full",
        "zero3-full",
        "fsdp-compile-selective",
        "tp2-sp-full",
        "tp2-compile-sel",
    ],
)
def test_activation_checkpointing_and_compile_keep_the_losses(args, single, workdir):
    per_rank = "task.data.batch_size=8" if "strategy=tensor" in args else "task.data.batch_size=4"
    probe = [
        "+callbacks.probe._target_=tests.tasks.TransformProbe",
        f"+callbacks.probe.out={workdir}",
    ]
    train(
        *args,
        per_rank,
        "trainer.devices=2",
        *GPT,
        "callbacks=none",
        *probe,
        "run.dir=run",
        cwd=workdir,
    )
    assert_same(workdir / "run", single["gpt8"])
    # proof the transforms were applied, not only harmless
    for rank in (0, 1):
        seen = json.loads((workdir / f"probe-rank{rank}.json").read_text())
        assert seen["norm_calls"] == 2, "the block's forward is recomputed in backward"
        assert (seen["graphs"] > 0) == ("trainer.compile=true" in args), seen
        if "strategy=fsdp" in args:
            assert seen["fsdp_units"] == ["GPT", "TransformerBlock", "TransformerBlock"], seen


def test_full_checkpointing_recomputes_collectives_and_selective_keeps_them(workdir):
    """Proof the blocks are checkpointed: recomputing a tp block's forward in backward repeats
    its all-reduce; the selective policy saves collective outputs instead."""
    tp = ["strategy=tensor", "trainer.devices=2", *GPT]
    full = comm_counts(workdir, *tp, "trainer.activation_checkpointing=full")
    assert full["GPTTask.model.blocks.0"]["backward"]["all_reduce"] > 2
    (workdir / "comm.json").unlink()
    selective = comm_counts(workdir / "run", *tp, "trainer.activation_checkpointing=selective")
    assert selective["GPTTask.model.blocks.0"]["backward"] == {"all_reduce": 2}


def test_a_custom_model_with_a_plan_in_the_config_matches_one_process(single, workdir):
    plan = "strategy.tp_plan=[net.0:colwise,net.3:rowwise]"
    args = ["strategy=tensor", plan, "trainer.devices=2", "task.data.batch_size=32"]
    train(*args, *DIGITS, "callbacks=none", "run.dir=run", cwd=workdir)
    assert_same(workdir / "run", single["digits"])
    counts = comm_counts(workdir / "run", *args, "task=digits")
    assert counts["DigitsTask.net.3"]["forward"] == {"all_reduce": 1}, "the plan was applied"


TP2 = ["strategy=tensor", "trainer.devices=2", "task.data.batch_size=16"]


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    """tp = 2 on gpt_tiny (global batch 16), 10 steps, checkpoint at 10: a first leg to resume
    from and a checkpoint to export, trained once."""
    run = tmp_path_factory.mktemp("tp2") / "run"
    save = ["callbacks.checkpoint.every_n_steps=10", "trainer.max_steps=10"]
    train(*TP2, *GPT, *save, f"run.dir={run}", cwd=run.parent)
    return run


@pytest.mark.parametrize(
    ("first", "second"),
    [
        (
            ["strategy=tensor", "trainer.devices=2", "task.data.batch_size=16"],
            ["strategy=ddp", "trainer.devices=1", "task.data.batch_size=16"],
        ),
        (
            ["strategy=ddp", "trainer.devices=1", "task.data.batch_size=16"],
            ["strategy=fsdp_tp", "trainer.devices=4", "task.data.batch_size=8"],
        ),
        # out of a 2-D mesh: test_moe.py's ep2-to-one-process and test_moves.py's fsdp moves
        (
            ["strategy=tensor", "trainer.devices=2", "task.data.batch_size=16"],
            ["strategy=tensor", "trainer.devices=2", "task.data.batch_size=16"],
        ),
    ],
    ids=["tp2-to-one-process", "one-process-to-fsdp2xtp2", "tp2-to-tp2"],
)
def test_resume_into_another_layout_continues_the_same_run(first, second, single, tp2, workdir):
    save = ["callbacks.checkpoint.every_n_steps=10"]
    if first == TP2:
        shutil.copytree(tp2, workdir / "run", symlinks=True)
    else:
        train(*first, *GPT, *save, "trainer.max_steps=10", "run.dir=run", cwd=workdir)
    err = train(*second, *GPT, *save, "trainer.max_steps=20", "run.dir=run", cwd=workdir)
    assert_resumed(err, workdir / "run", 20, moved=first != second)
    assert_same(workdir / "run", single["gpt16"])


def test_export_of_a_tensor_parallel_checkpoint_equals_the_one_process_model(single, tp2, workdir):
    assert fw("export", str(tp2), "tp.pt", cwd=workdir).returncode == 0
    ref = single["root"] / "gpt16" / "checkpoints" / "step00000010"
    assert fw("export", str(ref), "one.pt", cwd=workdir).returncode == 0
    a = torch.load(workdir / "tp.pt", weights_only=True)
    b = torch.load(workdir / "one.pt", weights_only=True)
    assert a.keys() == b.keys() and "model.blocks.0.attn.qkv.weight" in a
    assert all(a[k].shape == b[k].shape for k in a), "full shapes, not shards"
    assert all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["strategy=tensor", "strategy.tp=3"], "the degrees multiply to 3, but the job has 2"),
        (["strategy=fsdp_tp", "trainer.devices=3"], "does not divide the 3 processes"),
        (["strategy=tensor", "strategy.dp=-1", "strategy.tp=-1"], "only one degree may be -1"),
        (
            ["strategy=tensor", "strategy.ep=2"],
            "expert parallel borrows its ranks from the fsdp degree",
        ),
        (
            ["strategy=tensor", "experiment=gpt_tiny", "task.model.n_head=1"],
            "task.model.n_head=1: must be divisible by the tensor-parallel degree",
        ),
        (["strategy=tensor", "strategy.tp_plan=[net.0:diagonal]"], "not a known style"),
        (["strategy=tensor", "strategy.tp_plan=[colwise]"], "an entry is 'module:style'"),
        (
            ["strategy=tensor", "task=digits", "strategy.tp_plan=[net.0:colwise,net.9:rowwise]"],
            "'net.9' names no module of DigitsTask",
        ),
        (
            [
                "strategy=tensor",
                "strategy.sequence_parallel=true",
                "trainer.compile=true",
                "trainer.activation_checkpointing=selective",
            ],
            "trains wrong gradients in the installed torch",
        ),
        (
            [
                "strategy=tensor",
                "strategy.sequence_parallel=true",
                "experiment=gpt_tiny",
                "task.model.block_size=63",
            ],
            "task.model.block_size=63: must be divisible by the tensor-parallel degree",
        ),
    ],
)
def test_invalid_degrees_and_shapes_are_refused_before_launch(
    args, message, workdir, monkeypatch, capsys
):
    devices = [] if any(a.startswith("trainer.devices") for a in args) else ["trainer.devices=2"]
    assert message in refused([*devices, *args], workdir, monkeypatch, capsys)
