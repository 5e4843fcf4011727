"""Expert parallel: one MoE layer split over 2 ranks equals the whole layer (outputs and every
gradient); moe_gpt under ep = 2, ep 2 x fsdp, ep 2 x tp 2 and pp 2 x ep 2 routes every token as one
process does and reproduces its losses; the expert bias is updated once per optimizer step
(gradient accumulation, activation checkpointing); checkpoints move between ep degrees and
strategies; the all-to-all traffic is the formula's."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
import torch

from tests.conftest import FW, QUIET, assert_resumed, fw, fw_env, losses, read_metrics
from tests.distributed.conftest import torchrun_script

pytestmark = pytest.mark.slow
COMMON = [
    *QUIET,
    "experiment=moe_gpt_tiny",
    "task.scheduler.name=constant",
    "trainer.val_check_interval=20",
    "trainer.deterministic=true",
    "trainer.log_every_n_steps=1",
    "callbacks.checkpoint.every_n_steps=10",
    "logger=[csv]",
]
# the expert gradients' norms at step 1 (AdamW would hide a gradient off by a constant factor)
GRADS = ["+callbacks.grads._target_=tests.tasks.ExpertGradNorms", "+callbacks.grads.out=OUT"]


def train(*args: str, cwd) -> str:
    args = tuple(a.replace("OUT", str(cwd)) for a in args)
    result = fw("train", *COMMON, *args, cwd=cwd)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stderr


def routing(run) -> list[dict[str, str]]:
    """Per step, the tokens each expert of each layer received (summed over the data ranks)."""
    return [
        {k: v for k, v in row.items() if "/tokens_e" in k}
        for row in read_metrics(run)
        if row.get("moe/layer0/tokens_e0")
    ]


def expert_bias(run) -> dict[str, torch.Tensor]:
    from framework.cli import main  # `fw export` in this process: its start-up is paid elsewhere

    out = run.parent / f"{run.name}.pt"
    assert main(["export", str(run), str(out), "--force"]) == 0
    state = torch.load(out, weights_only=True)
    return {k: v for k, v in state.items() if k.endswith("expert_bias")}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """moe_gpt_tiny on one process, batch 16, 20 steps (checkpoint at 10 and 20)."""
    root = tmp_path_factory.mktemp("moe")
    one = ["strategy=ddp", "trainer.devices=1", "task.data.batch_size=16"]
    train(*one, *GRADS, "run.dir=run", cwd=root)
    return root / "run"


@pytest.fixture(scope="module")
def one_process_bias(one_process):
    """The expert biases of the one-process run, exported once."""
    return expert_bias(one_process)


def test_an_expert_parallel_layer_equals_the_whole_layer(tmp_path):
    for rank, found in enumerate(torchrun_script("moe_layer_check.py", tmp_path)):
        for dtype, bound in (("float64", 1e-12), ("float32", 1e-6)):
            diffs = {
                k: v for k, v in found[dtype].items() if k not in ("rows_sent", "gate_grad_scale")
            }
            assert max(diffs.values()) <= bound, (dtype, diffs)
        assert found["float64"]["rows_sent"] == (0 if rank == 0 else 16), "rank 0 sends nothing"


LAYOUTS = {
    "ep2": ["strategy=expert", "trainer.devices=2", "task.data.batch_size=8"],
    "ep2xfsdp": ["strategy=fsdp", "strategy.ep=2", "trainer.devices=4", "task.data.batch_size=4"],
    "ep2xtp2": [
        "strategy=fsdp",
        "strategy.tp=2",
        "strategy.ep=2",
        "trainer.devices=4",
        "task.data.batch_size=8",
    ],
    "pp2xep2": [
        "strategy=pipeline",
        "strategy.pp=2",
        "strategy.fsdp=2",
        "strategy.ep=2",
        "trainer.devices=4",
        "task.data.batch_size=8",
    ],
}


# experts per layer held by one rank: 4 split over ep = 2, and FSDP over the 2 ranks holding
# the same experts (efsdp) where fsdp = 4
LOCAL_EXPERTS = {"ep2": 2, "ep2xfsdp": 1, "ep2xtp2": 2, "pp2xep2": 2}
SHAPES = ["+callbacks.shapes._target_=tests.tasks.LocalShapes", "+callbacks.shapes.out=OUT"]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_expert_parallel_layouts_route_and_train_as_one_process(
    layout, one_process, one_process_bias, workdir
):
    train(*LAYOUTS[layout], *GRADS, *SHAPES, "run.dir=run", cwd=workdir)
    shapes = json.loads((workdir / "shapes-rank0.json").read_text())
    assert shapes["model.blocks.0.moe.experts.w1"] == [LOCAL_EXPERTS[layout], 64, 64]
    norms = json.loads((workdir / "expert-grads.json").read_text())
    want = json.loads((one_process.parent / "expert-grads.json").read_text())
    # rank 0 holds every layer, or under the pipeline the first stage's (3 weights per layer)
    assert set(norms) <= set(want) and len(norms) == (3 if "pp" in layout else 6)
    assert all(abs(norms[k] - want[k]) <= 1e-5 * want[k] for k in norms), (norms, want)
    got, want = routing(workdir / "run"), routing(one_process)
    assert len(got) == 20 and got == want, "every token goes to the same experts"
    a, b = losses(workdir / "run"), losses(one_process)
    assert sorted(a) == sorted(b) and all(abs(a[s] - b[s]) <= 1e-5 for s in b), (a, b)
    bias = expert_bias(workdir / "run")
    assert bias.keys() == one_process_bias.keys()
    assert all(torch.equal(v, one_process_bias[k]) for k, v in bias.items())
    assert any(v.abs().sum() > 0 for v in bias.values()), "the bias moved"


def test_the_bias_moves_once_per_optimizer_step(one_process, one_process_bias, workdir):
    """Counts neither split by accumulation nor doubled by the recompute in backward: 2
    microbatches of 8 with full activation checkpointing (one run for both: each alone would
    change the bias) route and move the bias as batches of 16 without."""
    args = ["task.data.batch_size=8", "trainer.accumulate_grad_batches=2"]
    args += ["trainer.activation_checkpointing=full"]
    train("strategy=ddp", "trainer.devices=1", *args, "run.dir=run", cwd=workdir)
    assert routing(workdir / "run") == routing(one_process)
    bias, want = expert_bias(workdir / "run"), one_process_bias
    assert all(torch.equal(v, want[k]) for k, v in bias.items())


ONE = ["strategy=ddp", "trainer.devices=1", "task.data.batch_size=16"]
MOVES = {"ep2-to-one-process": 20, "one-process-to-ep2": 14}  # the step each move trains to


@pytest.fixture(scope="module")
def moved(tmp_path_factory):
    """One run that moves from one process into ep = 2 at step 7 and back at step 14; per move,
    what it printed and the run directory as it left it."""
    root = tmp_path_factory.mktemp("moved")
    every = "callbacks.checkpoint.every_n_steps=7"
    train(*ONE, every, "trainer.max_steps=7", "run.dir=run", cwd=root)
    done = {}
    for move, layout in (("one-process-to-ep2", LAYOUTS["ep2"]), ("ep2-to-one-process", ONE)):
        err = train(*layout, every, f"trainer.max_steps={MOVES[move]}", "run.dir=run", cwd=root)
        shutil.copytree(root / "run", root / move, symlinks=True)
        done[move] = (err, root / move)
    return done


@pytest.mark.parametrize("move", list(MOVES))
def test_a_checkpoint_moves_between_expert_parallel_degrees(move, moved, one_process):
    err, run = moved[move]
    assert_resumed(err, run, MOVES[move], moved=True)
    a, b = losses(run), losses(one_process)
    assert all(abs(a[s] - b[s]) <= 1e-5 for s in a), (a, b)


def test_all_to_all_traffic_matches_the_formula_with_bfloat16_experts(workdir):
    """Round-robin routing (balanced): per layer and step 3 all-to-alls forward (token counts,
    dispatch, combine) and 2 backward; each rank sends T*k*(ep-1)/ep token rows.

    With FSDP2's bfloat16 param_dtype, where ep = fsdp = 2 leaves one rank holding each expert:
    it must reach the experts too (they were left fp32 and fed bfloat16 activations: a dtype
    error)."""
    counter = [
        "+callbacks.comm._target_=framework.debug.CommCounter",
        f"+callbacks.comm.out={workdir}",
    ]
    train(
        "task.model.routing=round_robin",
        *LAYOUTS["ep2"],
        "strategy.param_dtype=bfloat16",
        "trainer.max_steps=3",
        *counter,
        "run.dir=run",
        cwd=workdir,
    )
    assert len(losses(workdir / "run")) == 3
    counts = json.loads((workdir / "comm.json").read_text())
    layer = counts["MoEGPTTask.model.blocks.0.moe"]
    assert layer == {"forward": {"all_to_all_single": 3}, "backward": {"all_to_all_single": 2}}
    rows = [r for r in read_metrics(workdir / "run") if r.get("moe/layer0/rows_sent")]
    tokens, k, ep = 8 * 64, 2, 2  # per rank: batch 8 x block 64
    assert {float(r["moe/layer0/rows_sent"]) for r in rows} == {tokens * k * (ep - 1) / ep}


def test_load_metrics_reach_wandb_as_a_histogram(workdir):
    env = fw_env()
    env["WANDB_MODE"] = "offline"
    args = [*COMMON[:-1], "logger=[csv,wandb]", "trainer.max_steps=3", "run.dir=run"]
    result = subprocess.run(
        [str(FW), "train", *args], cwd=workdir, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    run = next((workdir / "run" / "wandb").glob("offline-run-*"))
    record = next(run.glob("run-*.wandb")).read_bytes()
    assert b"moe/layer0/tokens_per_expert" in record and b"moe/layer1/max_load" in record
    internal = (run / "logs" / "debug-internal.log").read_text()
    assert "ignoring partial history" not in internal, "W&B dropped rows logged at a stale step"
