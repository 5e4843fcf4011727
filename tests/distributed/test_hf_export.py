"""`fw export RUN OUT --format hf`: a plain LightningModule holding a transformers Llama, trained
under tensor=2, fsdp=2, pipeline=2 and zero3 (and a Qwen3-MoE under ep=2), comes out as a directory `AutoModelForCausalLM.from_pretrained` loads
with the trained model's logits (1e-5), sharded with an index past --max-shard-size; tied weights
are written once; a kill -9 mid-export leaves nothing at OUT; bad requests exit 2 writing nothing.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import FW, fw, fw_env

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM  # noqa: E402

from tests.hf_moe_tasks import PlainMoE  # noqa: E402
from tests.hf_pretrained import HOLD, RUNS, shared_runs  # noqa: E402
from tests.hf_tasks import PlainLlama  # noqa: E402


class HeldLlamaForCausalLM(LlamaForCausalLM):
    """A LlamaForCausalLM whose save_pretrained, when $FW_TEST_HOLD_EXPORT names a file, writes
    that file once every weight is written and then waits: `fw export` is killed there."""

    def save_pretrained(self, directory, **kwargs):
        super().save_pretrained(directory, **kwargs)
        marker = os.environ.get(HOLD)
        if marker:
            Path(marker).write_text(str(directory))
            time.sleep(300)


class HeldLlama(PlainLlama):
    """PlainLlama (same init, same training) holding its model as HeldLlamaForCausalLM."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.lm.__class__ = HeldLlamaForCausalLM


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Run directories of 3 steps (checkpoint at step 3; fsdp: 6 steps) under tensor=2, fsdp=2,
    pipeline=2, ep=2 (a Qwen3-MoE) and zero3 on 2 processes, and a digits run (no transformers
    model); shared with test_hf_resume.py."""
    return shared_runs(tmp_path_factory, [*RUNS, "digits"])


def tokens() -> torch.Tensor:
    return torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))


def trained_logits(run: Path, workdir: Path) -> torch.Tensor:
    """Logits of the run's model as the plain export holds it, loaded into the task's model
    (exported in this process: the `fw` start-up is paid by the hf exports)."""
    from framework.cli import main

    assert main(["export", str(run), str(workdir / "plain.pt"), "--force"]) == 0
    task = PlainMoE(hidden=64) if run.name == "expert" else PlainLlama(hidden=64)
    task.load_state_dict(torch.load(workdir / "plain.pt", weights_only=True))
    (workdir / "plain.pt").unlink()
    with torch.no_grad():
        return task.lm(tokens()).logits


def hf_logits(out: Path) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(out)
    with torch.no_grad():
        return model(tokens()).logits


@pytest.mark.parametrize("strategy", list(RUNS))
def test_from_pretrained_gives_the_trained_models_logits(runs, strategy, workdir):
    from framework.cli import main  # in this process: `fw`'s start-up is paid by the tests below

    assert main(["export", str(runs[strategy]), str(workdir / "hf"), "--format", "hf"]) == 0
    written = sorted(p.name for p in (workdir / "hf").iterdir())
    assert written == ["config.json", "generation_config.json", "model.safetensors"], written
    config = json.loads((workdir / "hf" / "config.json").read_text())
    family = "qwen3_moe" if strategy == "expert" else "llama"
    assert config["model_type"] == family and config["hidden_size"] == 64, config
    want = trained_logits(runs[strategy], workdir)
    got = hf_logits(workdir / "hf")
    assert (got - want).abs().max().item() <= 1e-5


def test_a_small_max_shard_size_writes_shards_and_an_index(runs, workdir):
    done = fw("export", runs["tensor"], "hf", "--format=hf", "--max-shard-size=64KB", cwd=workdir)
    assert done.returncode == 0, done.stderr[-3000:]
    out = workdir / "hf"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(out.glob("model-*-of-*.safetensors"))
    assert len(shards) >= 3 and not (out / "model.safetensors").exists()
    assert set(index["weight_map"].values()) == {p.name for p in shards}
    # one tensor bigger than the limit has a file of its own (the 64 KiB embedding: at most)
    assert all(p.stat().st_size <= 64 * 1024 + 4096 for p in shards)
    assert (hf_logits(out) - trained_logits(runs["tensor"], workdir)).abs().max() <= 1e-5


def test_tied_weights_are_written_once(tmp_path):
    from safetensors import safe_open

    from framework.integrations.hf.export import assign, save

    config = LlamaConfig(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    trained = LlamaForCausalLM(config)
    # a consolidated checkpoint holds both names, each its own copy
    weights = {k: v.detach().clone() for k, v in trained.state_dict().items()}
    assert "lm_head.weight" in weights
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    assign(model, weights, "lm")
    save(model, tmp_path, 2**30, None)
    with safe_open(tmp_path / "model.safetensors", "pt") as fh:
        names = set(fh.keys())
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    with torch.no_grad():
        got = AutoModelForCausalLM.from_pretrained(tmp_path)(tokens()).logits
        assert (got - trained(tokens()).logits).abs().max() <= 1e-5


def test_the_pretrained_directorys_tokenizer_files_are_copied(tmp_path):
    """A task whose model came from `task.model.pretrained=DIR` gets DIR's tokenizer files;
    a tokenizer named by `task.data.tokenizer` (the one the data was encoded with) comes first."""
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer

    from framework.integrations.hf.export import save, tokenizer_dir
    from tests.hf_pretrained import write_llama, write_word_tokenizer

    pretrained = write_llama(tmp_path / "pretrained")
    write_word_tokenizer(pretrained, ["the", "model", "came", "from", "here"])
    (pretrained / "notes.txt").write_text("not a tokenizer file")
    task_cfg = OmegaConf.create({"_target_": "x", "model": {"pretrained": str(pretrained)}})
    out = tmp_path / "out"
    out.mkdir()
    save(AutoModelForCausalLM.from_pretrained(pretrained), out, 2**30, tokenizer_dir(task_cfg))
    assert (out / "tokenizer.json").read_bytes() == (pretrained / "tokenizer.json").read_bytes()
    assert not (out / "notes.txt").exists()
    ids = AutoTokenizer.from_pretrained(out)("model came here").input_ids
    assert ids == [4, 1, 3], ids  # the word-level vocabulary, sorted, after [UNK]
    # the hf_lm recipe's task.data.tokenizer names the tokenizer it trained with: that one wins
    other = tmp_path / "other"
    write_word_tokenizer(other, ["here", "came", "a", "model"])
    task_cfg.data = {"tokenizer": str(other / "tokenizer.json")}
    assert tokenizer_dir(task_cfg) == other / "tokenizer.json"
    (out / "tokenizer.json").unlink()
    save(AutoModelForCausalLM.from_pretrained(pretrained), out, 2**30, tokenizer_dir(task_cfg))
    assert (out / "tokenizer.json").read_bytes() == (other / "tokenizer.json").read_bytes()
    task_cfg.data = {"tokenizer": "bytes"}
    assert tokenizer_dir(task_cfg) == pretrained


def test_a_killed_export_leaves_nothing_at_out_and_the_next_one_cleans_up(runs, workdir):
    marker = workdir / "written"
    env = {**fw_env(), HOLD: str(marker)}
    args = [str(FW), "export", str(runs["fsdp"]), "hf", "--format", "hf"]
    proc = subprocess.Popen(args, cwd=workdir, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert marker.exists(), "the export reached its hold point"
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == -signal.SIGKILL
    left = workdir / marker.read_text()  # as given: relative to the export's directory
    # every file was written, but under a hidden name: nothing at OUT looks complete
    assert (left / "model.safetensors").is_file() and left.parent == workdir
    assert left.name.startswith(".hf.") and left.name.endswith(".tmp")
    assert not (workdir / "hf").exists()
    again = fw("export", str(runs["fsdp"]), "hf", "--format", "hf", cwd=workdir)
    assert again.returncode == 0, again.stderr[-3000:]
    assert not left.exists(), "the killed export's directory was removed"
    assert sorted(p.name for p in workdir.iterdir()) == ["hf", "written"]
    assert (hf_logits(workdir / "hf") - trained_logits(runs["fsdp"], workdir)).abs().max() <= 1e-5


def refused_export(args: list[str], cwd: Path, capsys) -> str:
    """`fw export ARGS` in this process: exit 2, one line, nothing written in `cwd`."""
    from framework.cli import main

    before = set(cwd.iterdir())
    code = main(["export", *args])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("error: ") and len(err.splitlines()) == 1, err
    assert set(cwd.iterdir()) == before, "nothing written"
    return err


def test_bad_requests_exit_2_and_write_nothing(runs, workdir, capsys):
    out = str(workdir / "hf")
    err = refused_export([str(runs["tensor"]), out, "--format", "onnx"], workdir, capsys)
    assert "--format=onnx" in err and "pt, hf" in err
    err = refused_export([str(runs["digits"]), out, "--format", "hf"], workdir, capsys)
    assert "holds 0 transformers models" in err and "--format pt" in err
    err = refused_export(
        [str(runs["tensor"]), out, "--format=hf", "--max-shard-size=H100"], workdir, capsys
    )
    assert "--max-shard-size=H100" in err
    (workdir / "hf").mkdir()
    err = refused_export([str(runs["tensor"]), out, "--format", "hf"], workdir, capsys)
    assert "already exists" in err


def test_a_checkpoint_naming_a_class_that_is_no_task_is_not_built(runs, tmp_path, capsys):
    """The checkpoint's recorded config names the class export builds: only a LightningModule
    is built (a crafted `_target_: subprocess.Popen` would otherwise run a command)."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(runs["tensor"], run, symlinks=True)
    meta_path = run / "checkpoints" / "step00000003" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["config"]["task"] = {
        "_target_": "subprocess.Popen",
        "model": {"args": ["touch", str(tmp_path / "x")]},
    }
    meta_path.write_text(json.dumps(meta))
    err = refused_export([str(run), str(tmp_path / "hf"), "--format", "hf"], tmp_path, capsys)
    assert "task._target_=subprocess.Popen" in err and "not a LightningModule" in err
    assert not (tmp_path / "x").exists()
