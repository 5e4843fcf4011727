"""The hf_lm recipe: a transformers causal LM trains through `fw train` on bytes and with a
tokenizer written here; a pretrained model that is not a local directory of safetensors weights
is refused before launch, nothing downloaded, nothing written."""

from __future__ import annotations

import json

import pytest
import transformers  # noqa: F401 (the hf extra: missing, these fail, not skip)

from tests.conftest import QUIET, fw, losses, read_metrics, refused
from tests.hf_pretrained import write_llama, write_word_tokenizer

RUN = ["logger=[csv]", "callbacks=none", "trainer.log_every_n_steps=1", *QUIET]


@pytest.mark.slow
def test_trains_on_bytes_from_a_random_init(workdir):
    args = ["experiment=hf_lm_tiny", "trainer.max_steps=6", "trainer.val_check_interval=3"]
    result = fw("train", *args, *RUN, "run.dir=run", cwd=workdir)
    assert result.returncode == 0, result.stderr[-3000:]
    got = losses(workdir / "run")
    assert sorted(got) == list(range(6))
    assert abs(got[0] - 5.545) < 0.1, got  # ln 256: a fresh model's guess over 256 bytes
    assert got[5] < got[0]
    assert len([r for r in read_metrics(workdir / "run") if r.get("val/loss")]) == 2


@pytest.mark.slow
def test_trains_with_the_model_directory_tokenizer(workdir):
    """A pretrained directory with its tokenizer.json: the corpus is encoded with it (one
    token per word here), so an epoch has as many steps as the words make blocks."""
    words = [f"w{i}" for i in range(40)]
    model = write_llama(workdir / "model", vocab=64)
    assert write_word_tokenizer(model, words) == 41
    corpus = workdir / "corpus.txt"
    corpus.write_text(" ".join(words[i % 40] for i in range(4000)))  # 4000 tokens, 15999 bytes
    result = fw(
        "train",
        "task=hf_lm",
        f"task.model.pretrained={model}",
        f"task.data.path={corpus}",
        "task.data.block_size=16",
        "task.data.batch_size=8",
        "trainer.max_epochs=1",
        "trainer.limit_val_batches=2",
        *RUN,
        "run.dir=run",
        cwd=workdir,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # 95% of 4000 tokens in blocks of 16 (+1), batches of 8: bytes would give 118 steps
    steps = ((int(4000 * 0.95) - 1) // 16) // 8
    assert sorted(losses(workdir / "run")) == list(range(steps)) and steps == 29
    (report,) = json.loads((workdir / "run" / "pretrained" / "rank0.json").read_text())
    assert report["bytes_read"] == report["local_bytes"] > 0


def test_a_hub_id_is_refused(tmp_path, monkeypatch, capsys):
    err = refused(
        ["task=hf_lm", "task.model.pretrained=meta-llama/Llama-3-8B"], tmp_path, monkeypatch, capsys
    )
    assert "task.model.pretrained=meta-llama/Llama-3-8B" in err
    assert "no network: give a local directory" in err


def test_a_missing_directory_is_refused(tmp_path, monkeypatch, capsys):
    missing = tmp_path / "nope"
    err = refused(["task=hf_lm", f"task.model.pretrained={missing}"], tmp_path, monkeypatch, capsys)
    assert f"task.model.pretrained={missing}: is not a directory" in err
    assert "no network: give a local directory" in err


def test_a_directory_without_weights_is_refused(tmp_path, monkeypatch, capsys):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    (model / "pytorch_model.bin").write_bytes(b"")
    err = refused(["task=hf_lm", f"task.model.pretrained={model}"], tmp_path, monkeypatch, capsys)
    assert f"task.model.pretrained={model}: holds no *.safetensors weights" in err
    assert "no network: give a local directory" in err


def test_a_checkpoint_converted_while_loading_is_refused(tmp_path, monkeypatch, capsys):
    """A family whose files transformers converts while loading in a way the framework does
    not read slice by slice (GraniteMoE: its experts renamed by a regular expression) is refused
    before launch, not a failure in every worker. (Mixtral's and Qwen3-MoE's per-expert files
    load: tests/distributed/test_hf_pretrained.py.)"""
    from transformers import GraniteMoeConfig, GraniteMoeForCausalLM

    config = GraniteMoeConfig(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
    )
    model = tmp_path / "granitemoe"
    GraniteMoeForCausalLM(config).save_pretrained(model)
    capsys.readouterr()  # transformers' progress bar
    args = ["task=hf_lm", f"task.model.pretrained={model}", "task.data.tokenizer=bytes"]
    err = refused(args, tmp_path, monkeypatch, capsys)
    assert f"task.model.pretrained={model}: holds a 'granitemoe' checkpoint" in err
