"""Models nobody here wrote, split by tensor parallel without a plan written for them: Lightning's
own demo `LightningTransformer` (torch's `nn.Transformer`: its layers planned by their family,
attention by whole heads; its embedding and output layer inferred) and a transformers
`BertForSequenceClassification` fine-tune (transformers declares no plan for BERT: attention,
MLP and pooler inferred from a trace). Under strategy=tensor on 2 processes each rank holds at
most 60% of the parameters and the losses of 4 steps are one process's within 1e-5; the demo's
checkpoint exports to one process's weights, by name, whole."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import QUIET, fw, losses
from tests.distributed.conftest import torchrun_script

pytestmark = pytest.mark.slow
STEPS = 4
PLAIN = [
    "task=digits",
    "~task.model.hidden",
    "~task.model.dropout",
    "~task.data.val_fraction",
    "task.data.batch_size=8",  # tp ranks share one batch: one process's 8 sequences a step
    f"trainer.max_steps={STEPS}",
    "trainer.log_every_n_steps=1",
    "trainer.deterministic=true",
    "logger=[csv]",
    *QUIET,
]
DEMO = [
    "task._target_=tests.torch_tasks.DemoTransformer",
    "task.data._target_=tests.torch_tasks.TokenPairs",
    f"callbacks.checkpoint.every_n_steps={STEPS}",
]
BERT = [
    "task._target_=tests.hf_tasks.PlainBert",
    "task.data._target_=tests.hf_tasks.LabelledTokens",
    "callbacks=none",
]
TENSOR = ["strategy=tensor", "trainer.devices=2"]


def train(*args: str, cwd) -> str:
    result = fw("train", *PLAIN, *args, "run.dir=run", cwd=cwd)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stderr


def shards(out) -> list[str]:
    return ["+callbacks.shards._target_=tests.tasks.ShardCounter", f"+callbacks.shards.out={out}"]


def assert_split_and_same(root, reference) -> None:
    got, want = losses(root / "run"), losses(reference / "run")
    assert sorted(got) == sorted(want) == list(range(STEPS))
    assert all(abs(got[s] - want[s]) <= 1e-5 for s in want), (got, want)
    for rank in (0, 1):
        counts = json.loads((root / f"shards-rank{rank}.json").read_text())
        assert counts["params"] <= 0.6 * counts["full"], counts


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The demo transformer on one process and under tensor=2: (roots, tensor run's log)."""
    one, tp = tmp_path_factory.mktemp("demo_one"), tmp_path_factory.mktemp("demo_tp")
    train(*DEMO, cwd=one)
    log = train(*DEMO, *TENSOR, *shards(tp), cwd=tp)
    return one, tp, log


def test_multihead_attention_split_by_heads_equals_the_whole_module(tmp_path):
    for ranks in torchrun_script("multihead_check.py", tmp_path):
        for case, found in ranks.items():
            assert found.pop("same_names") == 1.0, case
            assert max(found.values()) <= 1e-12, (case, found)


def test_the_demo_transformer_splits_its_layers_by_heads_and_reproduces_one_process(demo):
    one, tp, log = demo
    assert_split_and_same(tp, one)
    layers = "model.transformer.decoder.layers.*"
    assert f"{layers}.multihead_attn:multihead_attention" in log, log[-3000:]
    assert f"{layers}.linear1:colwise, {layers}.linear2:rowwise" in log
    inferred = "strategy.tp_plan=[model.embedding:rowwise_embedding,model.decoder:colwise_gather]"
    assert inferred in log


def test_the_demo_transformers_tensor_parallel_checkpoint_exports_one_process_weights(
    demo, tmp_path
):
    from framework.cli import main  # `fw export` in this process: its start-up is paid elsewhere

    one, tp, _ = demo
    assert main(["export", str(tp / "run"), str(tmp_path / "tp.pt")]) == 0
    assert main(["export", str(one / "run"), str(tmp_path / "one.pt")]) == 0
    a = torch.load(tmp_path / "tp.pt", weights_only=True)
    b = torch.load(tmp_path / "one.pt", weights_only=True)
    packed = "model.transformer.encoder.layers.0.self_attn.in_proj_weight"
    assert a.keys() == b.keys() and a[packed].shape == (96, 32), "q, k, v whole, by name"
    assert all(a[k].shape == b[k].shape for k in a), "full shapes, not shards"
    assert all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)


def test_bert_without_a_plan_is_split_by_an_inferred_one_and_reproduces_one_process(
    tmp_path_factory,
):
    one, tp = tmp_path_factory.mktemp("bert_one"), tmp_path_factory.mktemp("bert_tp")
    train(*BERT, cwd=one)
    log = train(*BERT, *TENSOR, *shards(tp), cwd=tp)
    assert_split_and_same(tp, one)
    layer = "bert.bert.encoder.layer.*"
    for entry in (
        f"{layer}.attention.self.query:colwise",
        f"{layer}.attention.output.dense:rowwise",
        f"{layer}.output.dense:rowwise",
        "bert.bert.pooler.dense:colwise,bert.classifier:rowwise",
    ):
        assert entry in log, log[-3000:]
    assert "PlainBert declares no plan; inferred from its structure" in log
