"""`fw export RUN OUT --format hf`: a plain LightningModule holding a transformers Llama, trained
under tensor=2, fsdp=2, pipeline=2 and zero3 (and a Qwen3-MoE under ep=2), comes out as a
directory `AutoModelForCausalLM.from_pretrained` loads with the trained model's own logits (1e-5,
taken in the training processes at the end of training), sharded with an index past
--max-shard-size; tied weights are written once; the model is built from the checkpoint's
record of it, never from a class the run directory names, and no file outside the run directory
is copied; a kill -9 mid-export leaves nothing at OUT; bad requests exit 2 writing nothing.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from tests.conftest import fw, fw_env
from tests.hf_moe_tasks import PlainMoE
from tests.hf_pretrained import RUNS, logit_tokens, shared_runs
from tests.hf_tasks import PlainLlama

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Run directories of 3 steps (checkpoint at step 3; fsdp: 6 steps) under tensor=2, fsdp=2,
    pipeline=2, ep=2 (a Qwen3-MoE) and zero3 on 2 processes, and a digits run (no transformers
    model); shared with test_hf_resume.py."""
    return shared_runs(tmp_path_factory, [*RUNS, "digits"])


def tokens() -> torch.Tensor:
    return logit_tokens()


def trained_logits(run: Path, workdir: Path) -> torch.Tensor:
    """Logits of the run's model: those the training processes took at the end of training
    (FinalLogits), else (the pipeline, whose stages cannot run the model whole) those of its
    plain export loaded into the task's model."""
    from framework.cli import main

    if (run / "final_logits.pt").exists():
        return torch.load(run / "final_logits.pt", weights_only=True)
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


class MemorySource:
    """A checkpoint Source over tensors in memory (framework/checkpoint/portable.py)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def model(self):
        from framework.checkpoint.portable import TensorSpec

        return {n: TensorSpec(tuple(t.shape), t.dtype) for n, t in self.tensors.items()}

    def read(self, requests) -> None:
        for r in requests:
            box = self.tensors[r.key[1]]
            for d, (o, n) in enumerate(zip(r.offset, r.out.shape, strict=True)):
                box = box.narrow(d, o, n)
            r.out.copy_(box)


def test_tied_weights_are_written_once(tmp_path):
    from safetensors import safe_open

    from framework.integrations.hf.adapter import record
    from framework.integrations.hf.export import build, save

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
    # a checkpoint holds both names (as the task's `lm.` entries), each its own copy
    weights = {f"lm.{k}": v.detach().clone() for k, v in trained.state_dict().items()}
    assert "lm.lm_head.weight" in weights
    model = build(json.loads(json.dumps(record("lm", trained))))  # as meta.json keeps it
    save(model, "lm", MemorySource(weights), tmp_path, 2**30, tmp_path / "none")
    with safe_open(tmp_path / "model.safetensors", "pt") as fh:
        names = set(fh.keys())
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    with torch.no_grad():
        got = AutoModelForCausalLM.from_pretrained(tmp_path)(tokens()).logits
        assert (got - trained(tokens()).logits).abs().max() <= 1e-5


def test_only_the_runs_own_tokenizer_files_are_copied(runs, tmp_path, capsys):
    """The tokenizer comes from the run directory's `tokenizer/` (the hf_lm recipe copies the one
    it trains with there), plain files of a tokenizer's names only: a file outside the run
    directory that the checkpoint's config names (a private file of the person exporting) is
    never copied, nor a link planted in the run directory."""
    import shutil

    from transformers import AutoTokenizer

    from framework.cli import main
    from tests.hf_pretrained import write_word_tokenizer

    run = tmp_path / "run"
    shutil.copytree(runs["tensor"], run, symlinks=True)
    secret = tmp_path / "id_rsa"
    secret.write_text("PRIVATE KEY")
    meta_path = run / "checkpoints" / "step00000003" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["config"]["task"]["data"] = {"tokenizer": str(secret)}
    meta["config"]["task"]["model"] = {"pretrained": str(tmp_path)}
    meta_path.write_text(json.dumps(meta))
    write_word_tokenizer(run / "tokenizer", ["the", "model", "came", "from", "here"])
    (run / "tokenizer" / "notes.txt").write_text("not a tokenizer file")
    (run / "tokenizer" / "vocab.txt").symlink_to(secret)
    out = tmp_path / "hf"
    assert main(["export", str(run), str(out), "--format", "hf"]) == 0, capsys.readouterr().err
    assert (out / "tokenizer.json").read_bytes() == (
        run / "tokenizer" / "tokenizer.json"
    ).read_bytes()
    assert not (out / "notes.txt").exists() and not (out / "vocab.txt").exists()
    assert not any("PRIVATE" in p.read_text(errors="replace") for p in out.iterdir())
    ids = AutoTokenizer.from_pretrained(out)("model came here").input_ids
    assert ids == [4, 1, 3], ids  # the word-level vocabulary, sorted, after [UNK]


HOLD = """
import sys, time
from pathlib import Path
import framework.integrations.hf.export as export
copy = export.copy_tokenizer
def hold(directory, tmp):  # every weight is written: say where, then wait to be killed
    copy(directory, tmp)
    Path(sys.argv[1]).write_text(str(tmp))
    time.sleep(300)
export.copy_tokenizer = hold
from framework.cli import main
sys.exit(main(sys.argv[2:]))
"""


def test_a_killed_export_leaves_nothing_at_out_and_the_next_one_cleans_up(runs, workdir):
    marker = workdir / "written"
    args = [sys.executable, "-c", HOLD, str(marker), "export", str(runs["fsdp"]), "hf"]
    proc = subprocess.Popen(
        [*args, "--format", "hf"], cwd=workdir, env=fw_env(), start_new_session=True
    )
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
    assert "records no transformers model" in err and "--format pt" in err
    err = refused_export(
        [str(runs["tensor"]), out, "--format=hf", "--max-shard-size=H100"], workdir, capsys
    )
    assert "--max-shard-size=H100" in err
    err = refused_export([str(runs["tensor"]), out, "--max-shard-size=1GB"], workdir, capsys)
    assert "--max-shard-size=1GB" in err and "--format pt" in err and "hf" in err
    (workdir / "hf").mkdir()
    err = refused_export([str(runs["tensor"]), out, "--format", "hf"], workdir, capsys)
    assert "already exists" in err


def test_nothing_the_run_directory_names_is_imported_or_built(runs, tmp_path, capsys):
    """The model is built from the checkpoint's record (a transformers class, by name, out of
    transformers' own namespace): a crafted `_target_: subprocess.Popen` in its config is never
    imported or built, and a record naming anything but a transformers model is refused."""
    import shutil

    from framework.cli import main

    run = tmp_path / "run"
    shutil.copytree(runs["tensor"], run, symlinks=True)
    meta_path = run / "checkpoints" / "step00000003" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["config"]["task"] = {
        "_target_": "subprocess.Popen",
        "model": {"args": ["touch", str(tmp_path / "x")]},
    }
    meta_path.write_text(json.dumps(meta))
    assert main(["export", str(run), str(tmp_path / "hf"), "--format", "hf"]) == 0
    capsys.readouterr()  # the export's own report
    assert not (tmp_path / "x").exists()
    for named in ("Popen", "AutoTokenizer", "os.system"):
        meta["models"]["transformers"][0]["class"] = named
        meta_path.write_text(json.dumps(meta))
        err = refused_export([str(run), str(tmp_path / "hf2"), "--format", "hf"], tmp_path, capsys)
        assert f"source={named}" in err and "not a transformers model class" in err
    assert not (tmp_path / "x").exists()
