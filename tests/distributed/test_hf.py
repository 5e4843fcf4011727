"""A plain LightningModule holding a transformers LlamaForCausalLM (random init, no download):
under strategy=tensor its attention and MLP are split by the model's own plan, under fsdp its
decoder layers are the units, both reproducing one process; heads that do not split over tp are
refused before launch. Sequence parallel (Llama, Qwen2) and Qwen3's per-head norms under tp=2
reproduce one process too."""

from __future__ import annotations

import json

import pytest
import transformers  # noqa: F401 (the hf extra: missing, these fail, not skip)

from tests.conftest import QUIET, fw, losses, refused

pytestmark = pytest.mark.slow
PLAIN = [
    "task=digits",
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


def train(*args: str, cwd, family: str = "PlainLlama") -> str:
    task = f"task._target_=tests.hf_tasks.{family}"
    result = fw("train", task, *PLAIN, *args, "run.dir=run", cwd=cwd)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stderr


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """Losses of one process, batch 8: the reference of every layout here."""
    root = tmp_path_factory.mktemp("hf_one")
    train("task.data.batch_size=8", cwd=root)
    return losses(root / "run")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, one_process):
    """Task class in tests.hf_tasks -> its one-process losses (batch 8), made once when asked."""
    made = {"PlainLlama": one_process}

    def losses_of(family: str) -> dict[int, float]:
        if family not in made:
            root = tmp_path_factory.mktemp(f"hf_one_{family}")
            train("task.data.batch_size=8", cwd=root, family=family)
            made[family] = losses(root / "run")
        return made[family]

    return losses_of


def probes(out) -> list[str]:
    return [
        "+callbacks.shards._target_=tests.tasks.ShardCounter",
        f"+callbacks.shards.out={out}",
        "+callbacks.positions._target_=tests.hf_tasks.HiddenPositions",
        f"+callbacks.positions.out={out}",
    ]


def assert_split(out, positions: int) -> None:
    """Each rank holds at most 55% of the parameter elements (only norms stay whole), and its
    decoder layers hand on `positions` positions of each 16-token sequence."""
    for rank in (0, 1):
        counts = json.loads((out / f"shards-rank{rank}.json").read_text())
        assert counts["params"] <= 0.55 * counts["full"], counts
        seen = json.loads((out / f"positions-rank{rank}.json").read_text())
        assert len(seen) == 2 and set(seen.values()) == {positions}, seen


def assert_same(got: dict[int, float], want: dict[int, float]) -> None:
    assert sorted(got) == sorted(want) and len(got) == 10
    assert all(abs(got[s] - want[s]) <= 1e-5 for s in want), (got, want)


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
    llama = "task._target_=tests.hf_tasks.PlainLlama"
    args = [llama, *PLAIN, "strategy=tensor", "trainer.devices=2", "+task.model.kv_heads=1"]
    err = refused(args, tmp_path, monkeypatch, capsys)
    assert "lm.config.num_key_value_heads=1" in err and "1 key/value heads" in err, err


@pytest.mark.parametrize("family", ["PlainLlama", "PlainQwen2"])
def test_sequence_parallel_splits_the_residual_stream_over_the_sequence(
    family, reference, tmp_path
):
    """tp=2 with sequence_parallel: norms run on half of each sequence; the same losses."""
    args = ["strategy=tensor", "strategy.sequence_parallel=true", "trainer.devices=2"]
    train(*args, "task.data.batch_size=8", *probes(tmp_path), cwd=tmp_path, family=family)
    assert_same(losses(tmp_path / "run"), reference(family))
    assert_split(tmp_path, positions=8)


def test_tensor_parallel_splits_attention_and_mlp_by_the_model_plan(reference, tmp_path):
    """tp=2 by the model's own tp_plan, on Qwen3 (Llama's plan plus per-head norms; Llama under
    tp: the sequence-parallel case above, test_hf_export.py's tensor run and test_hf_resume.py's
    fsdp_tp run): the same losses as one process, each rank holding at most 55% of the weights.
    Qwen3's q_norm/k_norm (replicated_with_grad_allreduce) see only this rank's heads: their
    weights stay whole and their gradients are summed over the ranks."""
    args = ["strategy=tensor", "trainer.devices=2", "task.data.batch_size=8"]
    # tp ranks share one batch: the same 8 sequences a step as one process
    log = train(*args, *probes(tmp_path), cwd=tmp_path, family="PlainQwen3")
    assert_same(losses(tmp_path / "run"), reference("PlainQwen3"))
    assert_split(tmp_path, positions=16)
    assert "inferred from its structure" not in log
    for entry in ("self_attn.k_proj:colwise", "self_attn.o_proj:rowwise", "mlp.down_proj:rowwise"):
        assert f"lm.model.layers.*.{entry}" in log, log[-3000:]
