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


def assert_same(run, want, steps: int = 20) -> None:
    """The run's losses are the reference's first `steps` within 1e-5."""
    got = losses(run)
    assert sorted(got) == sorted(want)[:steps] and len(got) == steps
    assert all(abs(got[s] - want[s]) <= 1e-5 for s in got), (got, want)


# CommCounter writes a run's collectives of step 2 next to it (comm.json): the tests of the
# collectives below read those of these layouts' runs, one run for both kinds of assertion (the
# activation-checkpointing ones too: full recomputes a block's collectives in backward,
# selective keeps them)
COUNTER = ["+callbacks.comm._target_=framework.debug.CommCounter", "+callbacks.comm.out=OUT"]
# step 1 of every rank recorded and held to NCCL's rules (nccl-rules.json in the run)
NCCL = ["+callbacks.nccl._target_=tests.tasks.RecordNcclRules"]
LAYOUTS = {
    "tp2": (["strategy=tensor", "trainer.devices=2", "task.data.batch_size=8", *COUNTER], "gpt8"),
    # plain dp2xtp2: covered by its -sp-selective-ac variant below; fsdp2xtp2 (with sequence
    # parallel and full checkpointing, 4 processes against one):
    # test_activation_checkpointing_and_compile_keep_the_losses
    "tp2-sp-selective-ac": (
        [
            "strategy=tensor",
            "strategy.sequence_parallel=true",
            "trainer.activation_checkpointing=selective",
            "trainer.devices=2",
            *COUNTER,
        ],
        "gpt8",
    ),
    "tp2-gathered-logits-full-ac": (
        [
            "strategy=tensor",
            "strategy.loss_parallel=false",
            "trainer.activation_checkpointing=full",
            "trainer.devices=2",
            *COUNTER,
        ],
        "gpt8",
    ),
    "dp2xtp2-sp-selective-ac": (
        [
            "strategy=tensor",
            "strategy.dp=2",
            "strategy.tp=2",
            "strategy.sequence_parallel=true",
            "trainer.activation_checkpointing=selective",
            "trainer.devices=4",
            *NCCL,
        ],
        "gpt16",
    ),
}


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    """The run directory of a layout of LAYOUTS on gpt_tiny (20 steps, speed measured),
    trained once, on first use."""
    done = {}

    def run(name: str):
        if name not in done:
            cwd = tmp_path_factory.mktemp(name)
            args = [a.replace("OUT", str(cwd)) for a in LAYOUTS[name][0]]
            speed = ["+callbacks.throughput.kind=throughput"]
            train(*args, *GPT, "callbacks=none", *speed, "run.dir=run", cwd=cwd)
            done[name] = cwd / "run"
        return done[name]

    return run


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_tensor_parallel_layouts_reproduce_one_process_on_gpt(name, layouts, single):
    (args, reference), run = LAYOUTS[name], layouts(name)
    assert_same(run, single[reference])
    # samples per step = the global batch: tensor-parallel ranks share theirs, not add to it
    rows = [r for r in read_metrics(run) if r.get("perf/samples_per_sec")]
    assert rows, "throughput was logged"
    for row in rows:
        ratio = float(row["perf/samples_per_sec"]) / float(row["perf/steps_per_sec"])
        assert ratio == pytest.approx(int(reference.removeprefix("gpt")))
    # counted FLOPs per device: each rank's share of the reference's batch (the recomputed
    # forward of activation checkpointing counts too, so those layouts are left out here)
    if not any("activation_checkpointing" in a for a in args):
        devices = int(next(a for a in args if a.startswith("trainer.devices=")).split("=")[1])
        (ours,), (whole,) = flops(run), flops(single["root"] / reference)
        assert ours == pytest.approx(whole / devices, rel=0.02)


def test_a_fsdp_x_tensor_parallel_step_keeps_nccls_rules(layouts):
    """The tensor-parallel all-reduces, sequence parallel's gathers and scatters and FSDP's of
    a dp2 x tp2 step, recorded on the CPU, are handed only tensors on the device: what NCCL
    requires and gloo forgives (framework/parallel/nccl_rules.py)."""
    found = json.loads((layouts("dp2xtp2-sp-selective-ac") / "nccl-rules.json").read_text())
    assert {"all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor"} <= set(found["ops"])
    assert found["violations"] == []


def flops(run) -> set[float]:
    return {
        float(r["perf/flops_per_batch"]) for r in read_metrics(run) if r.get("perf/flops_per_batch")
    }


def counted(run) -> dict:
    """The collectives of step 2 that CommCounter wrote next to `run`."""
    return json.loads((run.parent / "comm.json").read_text())


def test_each_transformer_block_costs_two_all_reduces_forward_and_two_backward(layouts):
    counts = counted(layouts("tp2"))
    blocks = [k for k in counts if k.startswith("GPTTask.model.blocks.") and k.count(".") == 3]
    assert len(blocks) == 2  # gpt_tiny has 2 layers
    for block in blocks:
        assert counts[block] == {"forward": {"all_reduce": 2}, "backward": {"all_reduce": 2}}
    # vocabulary-parallel embedding: one all-reduce; the logits stay split over the vocabulary
    # (loss_parallel): the head gathers nothing, the loss all-reduces per-token statistics only
    assert counts["GPTTask.model.tok"]["forward"] == {"all_reduce": 1}
    assert counts["GPTTask.model.head"]["forward"] == {}
    gathered = counted(layouts("tp2-gathered-logits-full-ac"))
    assert gathered["GPTTask.model.head"]["forward"] == {"all_gather_into_tensor": 1}
    # full activation checkpointing: a block's forward, recomputed in backward, repeats its
    # all-reduces (the proof the blocks are checkpointed)
    assert gathered["GPTTask.model.blocks.0"]["backward"]["all_reduce"] > 2


def test_sequence_parallel_blocks_all_gather_and_reduce_scatter_instead(layouts):
    """Under selective activation checkpointing, which saves the collectives' outputs: the
    backward repeats none of the forward's."""
    counts = counted(layouts("tp2-sp-selective-ac"))
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
            "strategy=fsdp_tp",
            "strategy.sequence_parallel=true",
            "trainer.activation_checkpointing=full",
            "trainer.devices=4",
        ],
        ["strategy=tensor", "trainer.compile=true", "trainer.activation_checkpointing=selective"],
    ],
    ids=[
        "ddp-compile-full",
        "zero3-full",
        "fsdp-compile-selective",
        "fsdp2xtp2-sp-full",
        "tp2-compile-sel",
    ],
)
def test_activation_checkpointing_and_compile_keep_the_losses(args, single, workdir):
    # the global batch of gpt8: tensor-parallel ranks share theirs, the others add theirs up
    per_rank = "task.data.batch_size=8" if "strategy=tensor" in args else "task.data.batch_size=4"
    devices = [] if any(a.startswith("trainer.devices=") for a in args) else ["trainer.devices=2"]
    probe = [
        "+callbacks.probe._target_=tests.tasks.TransformProbe",
        f"+callbacks.probe.out={workdir}",
    ]
    # 10 steps: a transform that changed the numerics shows from the first; zero3's step with
    # recomputation is the slowest of the suite's layouts on the CPU
    train(
        *args,
        per_rank,
        *devices,
        *GPT,
        "trainer.max_steps=10",
        "callbacks=none",
        *probe,
        "run.dir=run",
        cwd=workdir,
    )
    assert_same(workdir / "run", single["gpt8"], steps=10)
    # proof the transforms were applied, not only harmless
    for rank in (0, 1):
        seen = json.loads((workdir / f"probe-rank{rank}.json").read_text())
        assert seen["norm_calls"] == 2, "the block's forward is recomputed in backward"
        assert (seen["graphs"] > 0) == ("trainer.compile=true" in args), seen
        if "strategy=fsdp" in args:
            assert seen["fsdp_units"] == ["GPT", "TransformerBlock", "TransformerBlock"], seen


def test_a_custom_model_with_a_plan_in_the_config_matches_one_process(single, workdir):
    plan = "strategy.tp_plan=[net.0:colwise,net.3:rowwise]"
    args = ["strategy=tensor", plan, "trainer.devices=2", "task.data.batch_size=32"]
    counter = [a.replace("OUT", str(workdir)) for a in COUNTER]
    train(*args, *DIGITS, "callbacks=none", *counter, "run.dir=run", cwd=workdir)
    assert_same(workdir / "run", single["digits"])
    counts = counted(workdir / "run")
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


ONE = ["strategy=ddp", "trainer.devices=1", "task.data.batch_size=16"]
FSDP2XTP2 = ["strategy=fsdp_tp", "trainer.devices=4", "task.data.batch_size=8"]
# each move continues tp2's run: (the layout it continues in, the step it trains to), one run
# tp2 -> one process -> fsdp2xtp2; out of a 2-D mesh: test_moe.py's ep2-to-one-process and
# test_moves.py's fsdp moves; a resume into the same tensor-parallel layout (no move):
# test_hf_resume.py's kill -9 under fsdp_tp, bitwise
MOVES = {
    "tp2-to-one-process": (ONE, 15),
    "one-process-to-fsdp2xtp2": (FSDP2XTP2, 20),
}


@pytest.fixture(scope="module")
def moved(tp2, tmp_path_factory):
    """Per move of MOVES: what it printed, and the run directory as it left it."""
    root = tmp_path_factory.mktemp("moved")
    save = ["callbacks.checkpoint.every_n_steps=5"]
    done = {}
    run = root / "run"
    shutil.copytree(tp2, run, symlinks=True)
    for move, (layout, steps) in MOVES.items():
        err = train(*layout, *GPT, *save, f"trainer.max_steps={steps}", "run.dir=run", cwd=root)
        shutil.copytree(run, root / move, symlinks=True)
        done[move] = (err, root / move)
    return done


@pytest.mark.parametrize("move", list(MOVES))
def test_resume_into_another_layout_continues_the_same_run(move, moved, single):
    (err, run), steps = moved[move], MOVES[move][1]
    assert_resumed(err, run, steps, moved=True)
    got, want = losses(run), single["gpt16"]
    assert sorted(got) == list(range(steps))
    assert all(abs(got[s] - want[s]) <= 1e-5 for s in got), (got, want)


def test_export_of_a_tensor_parallel_checkpoint_equals_the_one_process_model(single, tp2, workdir):
    from framework.cli import main  # `fw export` in this process: its start-up is paid elsewhere

    assert main(["export", str(tp2), str(workdir / "tp.pt")]) == 0
    ref = single["root"] / "gpt16" / "checkpoints" / "step00000010"
    assert main(["export", str(ref), str(workdir / "one.pt")]) == 0
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
