"""A plain LightningModule holding a transformers LlamaForCausalLM (random init, no download):
under strategy=tensor its attention and MLP are split by the model's own plan, under fsdp its
decoder layers are the units, both reproducing one process; heads that do not split over tp are
refused before launch."""

from __future__ import annotations

import json

import pytest

from tests.conftest import QUIET, fw, losses, refused

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow
PLAIN = [
    "task=digits",
    "task._target_=tests.hf_tasks.PlainLlama",
    "~task.model.dropout",
    "task.model.hidden=64",
    "task.data._target_=tests.hf_tasks.RandomTokens",
    "~task.data.val_fraction",
    "trainer.max_steps=10",
    "trainer.log_every_n_steps=1",
    "trainer.deterministic=true",
    "logger=[csv]",
    "callbacks=none",
    *QUIET,
]


def train(*args: str, cwd) -> str:
    result = fw("train", *PLAIN, *args, "run.dir=run", cwd=cwd)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stderr


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """Losses of one process, batch 8: the reference of every layout here."""
    root = tmp_path_factory.mktemp("hf_one")
    train("task.data.batch_size=8", cwd=root)
    return losses(root / "run")


def assert_same(got: dict[int, float], want: dict[int, float]) -> None:
    assert sorted(got) == sorted(want) and len(got) == 10
    assert all(abs(got[s] - want[s]) <= 1e-5 for s in want), (got, want)


def test_tensor_parallel_splits_attention_and_mlp_by_the_model_plan(one_process, tmp_path):
    shards = [
        "+callbacks.shards._target_=tests.tasks.ShardCounter",
        f"+callbacks.shards.out={tmp_path}",
    ]
    # tp ranks share one batch: the same 8 sequences a step as one process
    log = train(
        "strategy=tensor", "trainer.devices=2", "task.data.batch_size=8", *shards, cwd=tmp_path
    )
    assert_same(losses(tmp_path / "run"), one_process)
    for rank in (0, 1):
        counts = json.loads((tmp_path / f"shards-rank{rank}.json").read_text())
        # only the norms (320 of 106816 elements) stay whole; before, all but the embedding did
        assert counts["params"] <= 0.55 * counts["full"], counts
    assert "split automatically" not in log
    for entry in ("self_attn.k_proj:colwise", "self_attn.o_proj:rowwise", "mlp.down_proj:rowwise"):
        assert f"lm.model.layers.*.{entry}" in log


def test_fsdp_units_are_the_decoder_layers(one_process, tmp_path):
    probe = [
        "+callbacks.units._target_=tests.hf_tasks.FSDPUnits",
        f"+callbacks.units.out={tmp_path}",
    ]
    train("strategy=fsdp", "trainer.devices=2", "task.data.batch_size=4", *probe, cwd=tmp_path)
    assert_same(losses(tmp_path / "run"), one_process)
    for rank in (0, 1):
        units = json.loads((tmp_path / f"units-rank{rank}.json").read_text())
        assert units == ["LlamaDecoderLayer", "LlamaDecoderLayer", "LlamaForCausalLM"], units


def test_key_value_heads_that_do_not_split_over_tp_are_refused(tmp_path, monkeypatch, capsys):
    args = [*PLAIN, "strategy=tensor", "trainer.devices=2", "+task.model.kv_heads=1"]
    err = refused(args, tmp_path, monkeypatch, capsys)
    assert "lm.config.num_key_value_heads=1" in err and "1 key/value heads" in err, err
