"""Expert parallel for transformers MoE models: a plain LightningModule holding a tiny Qwen3-MoE
or Mixtral (random init, no download) under ep = 2, ep = 2 x fsdp = 2, ep = 2 x tp = 2 with
sequence parallel (the attention and q/k norms split by the model's plan, the experts by ep, each
MoE block run whole on the gathered sequence) and pp = 2 x ep = 2 (stages cut from the model's
pp_plan, each stage's ranks an ep group) trains as one process does: the same losses, every
token to the same experts, the same gradients; the framework's load metrics are logged and
count what the model's own routers chose; each rank holds its share of the experts; the
checkpoint exports to a directory transformers loads by the model's own names. The one-process
reference is transformers' own forward (nothing is swapped without ep)."""

from __future__ import annotations

import json

import pytest
import torch
import transformers  # noqa: F401 (the hf extra: missing, these fail, not skip)

from tests.conftest import QUIET, fw, losses, read_metrics

pytestmark = pytest.mark.slow
PLAIN = [
    "task=digits",
    "task._target_=tests.hf_moe_tasks.PlainMoE",
    "~task.model.dropout",
    "task.model.hidden=64",
    "task.data._target_=tests.hf_tasks.RandomTokens",
    "~task.data.val_fraction",
    "trainer.max_steps=10",
    "trainer.log_every_n_steps=1",
    "trainer.deterministic=true",
    "logger=[csv]",
    "callbacks=none",
    "+callbacks.moe.kind=moe",
    "+callbacks.routes._target_=tests.hf_moe_tasks.RouterCounts",
    "+callbacks.routes.out=OUT",
    "+callbacks.grads._target_=tests.hf_moe_tasks.GradNorms",
    "+callbacks.grads.out=OUT",
    *QUIET,
]
LAYOUTS = {
    "ep2": ["strategy=expert", "trainer.devices=2", "task.data.batch_size=4"],
    "ep2xfsdp2": ["strategy=fsdp", "strategy.ep=2", "trainer.devices=4", "task.data.batch_size=2"],
    # tp ranks share a batch: 2 data ranks of 4 sequences; attention split by the model's plan,
    # the residual stream by the sequence (each MoE block run whole on the gathered sequence)
    "ep2xtp2-sp": [
        "strategy=fsdp_tp",
        "strategy.ep=2",
        "strategy.sequence_parallel=true",
        "trainer.devices=4",
        "task.data.batch_size=4",
    ],
    # stages cut from the model's pp_plan; the 2 ranks of a stage are its ep group (and its 2
    # data ranks of 4 sequences): each stage's all-to-all runs in its own schedule's order
    "pp2xep2": [
        "strategy=pipeline",
        "strategy.pp=2",
        "strategy.fsdp=2",
        "strategy.ep=2",
        "strategy.microbatches=2",
        "trainer.devices=4",
        "task.data.batch_size=4",
    ],
}
# of 4 per layer: split over ep, then FSDP over efsdp; tp ranks keep the same experts whole
LOCAL_EXPERTS = {"ep2": 2, "ep2xfsdp2": 1, "ep2xtp2-sp": 2, "pp2xep2": 2}
SHAPES = ["+callbacks.shapes._target_=tests.tasks.LocalShapes", "+callbacks.shapes.out=OUT"]
CHECKPOINT = ["+callbacks.checkpoint.kind=checkpoint", "+callbacks.checkpoint.every_n_steps=10"]


def train(family: str, *args: str, cwd) -> None:
    every = [a.replace("OUT", str(cwd)) for a in (*PLAIN, *args)]
    result = fw("train", *every, f"+task.model.family={family}", "run.dir=run", cwd=cwd)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """family -> directory of its one-process run (batch 8), each made once when first asked."""
    made = {}

    def reference(family: str):
        if family not in made:
            root = tmp_path_factory.mktemp(f"hf_moe_{family}")
            train(family, "task.data.batch_size=8", cwd=root)
            made[family] = root
        return made[family]

    return reference


@pytest.fixture(scope="module")
def expert_parallel(tmp_path_factory):
    """(family, layout) -> directory of its run (checkpoint at step 10), made once when asked."""
    made = {}

    def run(family: str, layout: str):
        if (family, layout) not in made:
            root = tmp_path_factory.mktemp(f"hf_moe_{family}_{layout}")
            train(family, *LAYOUTS[layout], *SHAPES, *CHECKPOINT, cwd=root)
            made[family, layout] = root
        return made[family, layout]

    return run


def logged_counts(run) -> list[list[list[int]]]:
    """Per step and layer, the tokens per expert callbacks.moe logged."""
    rows = [r for r in read_metrics(run) if r.get("moe/layer0/tokens_e0")]
    return [
        [[int(float(r[f"moe/layer{i}/tokens_e{e}"])) for e in range(4)] for i in range(2)]
        for r in rows
    ]


@pytest.mark.parametrize(
    ("family", "layout"),
    [
        ("qwen3_moe", "ep2"),
        ("mixtral", "ep2"),
        ("mixtral", "ep2xfsdp2"),
        ("qwen3_moe", "ep2xtp2-sp"),
        ("qwen3_moe", "pp2xep2"),
    ],
)
def test_expert_parallel_trains_a_transformers_moe_model_as_one_process(
    family, layout, one_process, expert_parallel
):
    want, got_dir = one_process(family), expert_parallel(family, layout)
    piped = layout.startswith("pp")
    a, b = losses(got_dir / "run"), losses(want / "run")
    assert sorted(a) == sorted(b) and len(a) == 10
    assert all(abs(a[s] - b[s]) <= 1e-5 for s in b), (a, b)
    routed = json.loads((want / "router-counts.json").read_text())
    assert len(routed) == 10
    if not piped:  # a pipeline's stages infer their shapes with one forward more (uncounted)
        assert json.loads((got_dir / "router-counts.json").read_text()) == routed
    assert logged_counts(got_dir / "run") == routed, "load metrics count the routers' choices"
    rows = [r for r in read_metrics(got_dir / "run") if r.get("moe/layer1/max_load")]
    assert len(rows) == 10 and all(float(r["moe/layer1/rows_sent"]) > 0 for r in rows)
    assert all(r.get("moe/layer0/entropy") for r in rows)
    assert not any("moe/" in k for k in read_metrics(want / "run")[0]), "one process: not swapped"
    got, ref = (json.loads((d / "grad-norms.json").read_text()) for d in (got_dir, want))
    # rank 0 holds every layer, or under the pipeline the first stage's: layer 0, no head
    if piped:
        assert set(got) < set(ref) and "lm.model.layers.0.mlp.experts.gate_up_proj" in got
        assert not any(".layers.1." in k or "lm_head" in k for k in got), sorted(got)
    else:
        assert got.keys() == ref.keys() and any(".experts.gate_up_proj" in k for k in got)
    assert all(abs(got[k] - ref[k]) <= 1e-5 * ref[k] for k in got), (got, ref)
    shapes = json.loads((got_dir / "shapes-rank0.json").read_text())
    experts = LOCAL_EXPERTS[layout]
    assert shapes["lm.model.layers.0.mlp.experts.gate_up_proj"] == [experts, 64, 64]
    if not piped:
        assert shapes["lm.model.layers.1.mlp.experts.down_proj"] == [experts, 64, 32]
    if layout == "ep2xtp2-sp":  # o_proj (64 x 64) split by tp over its inputs, then FSDP's rows
        assert shapes["lm.model.layers.0.self_attn.o_proj.weight"] == [32, 32], shapes


def test_an_expert_parallel_checkpoint_exports_to_the_hugging_face_format(
    expert_parallel, tmp_path
):
    """The experts saved split over ep = 2 come out whole, under the model's own names."""
    from transformers import AutoModelForCausalLM

    run = expert_parallel("qwen3_moe", "ep2") / "run"
    for args in (["plain.pt"], ["hf", "--format", "hf"]):
        result = fw("export", str(run), str(tmp_path / args[0]), *args[1:])
        assert result.returncode == 0, result.stderr[-3000:]
    state = torch.load(tmp_path / "plain.pt", weights_only=True)
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched weight
    loaded = model.state_dict()
    assert loaded["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 64, 64)
    for name, tensor in loaded.items():
        assert torch.equal(tensor, state[f"lm.{name}"]), name
