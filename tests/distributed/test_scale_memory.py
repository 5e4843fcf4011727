"""No rank holds the whole training state while it resumes on another layout, loads pretrained
weights, or exports: measured from the processes themselves (their resident high-water mark,
`framework.debug.PeakMemory`), against a fresh start of the same job, on a model big enough that
a whole extra copy of its state is far above the noise (a gpt of ~13 M parameters: 50 MiB of
fp32 weights, 150 MiB of training state with AdamW's moments)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.conftest import QUIET, assert_resumed, fw

pytestmark = pytest.mark.slow

GPT = [
    *QUIET,
    "task=gpt",
    "task.model.n_layer=4",
    "task.model.n_embd=512",
    "task.model.n_head=8",
    "task.data.max_bytes=200000",
    "task.data.batch_size=4",
    "trainer.limit_val_batches=0",
    "logger=[csv]",
    "callbacks.checkpoint.every_n_steps=2",
]
PROBE = "+callbacks.peak._target_=framework.debug.PeakMemory"
FSDP2 = ["strategy=fsdp", "trainer.devices=2"]


def parameters() -> int:
    """Elements of the gpt above (built on meta: no memory)."""
    from omegaconf import OmegaConf

    from framework.config.compose import compose_config
    from framework.instantiate import build_task

    cfg = compose_config([a for a in GPT if not a.startswith(("trainer.enable", "+"))])
    with torch.device("meta"):
        task = build_task(OmegaConf.create(OmegaConf.to_container(cfg.task, resolve=True)))
    return sum(p.numel() for p in task.parameters())


def train(run: Path, *args: str, probe: Path | None = None) -> str:
    extra = [PROBE, f"+callbacks.peak.out={probe}"] if probe is not None else []
    result = fw("train", *GPT, *args, *extra, f"run.dir={run}", cwd=run.parent, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stderr


def peaks(probe: Path, world: int) -> list[int]:
    return [json.loads((probe / f"rank{r}.json").read_text())["first_step"] for r in range(world)]


@pytest.fixture(scope="module")
def fresh(tmp_path_factory) -> list[int]:
    """Each rank's resident high-water mark after its first step of a fresh fsdp x2 start."""
    root = tmp_path_factory.mktemp("fresh")
    train(root / "run", *FSDP2, "trainer.max_steps=1", probe=root / "peak")
    return peaks(root / "peak", 2)


@pytest.mark.parametrize(
    "written",
    [["strategy=ddp", "trainer.devices=1"], ["strategy=tensor", "trainer.devices=2"]],
    ids=["lightning-ddp1", "dcp-tensor2"],
)
def test_a_resume_on_another_layout_reads_only_each_ranks_share(fresh, written, tmp_path):
    """ddp's one file, or tensor parallel's column/row DCP shards, resumed under fsdp x2: each
    rank's high-water mark rises over a fresh fsdp x2 start by far less than half the state
    (the readers hold one piece of one tensor at a time; reading the whole state, as a rank
    did before, costs it at least the whole state)."""
    run = tmp_path / "run"
    train(run, *written, "trainer.max_steps=2")
    err = train(run, *FSDP2, "trainer.max_steps=3", probe=tmp_path / "peak")
    assert_resumed(err, run, 3, moved=True)
    state = parameters() * 4 * 3  # fp32 weights and AdamW's two moments
    extra = [got - base for got, base in zip(peaks(tmp_path / "peak", 2), fresh, strict=True)]
    print(
        f"\nresume {written[0]}: extra per rank {[e >> 20 for e in extra]} MiB, state {state >> 20} MiB"
    )
    assert all(e < 0.25 * state for e in extra), (extra, state)


def test_export_streams_one_tensor_at_a_time(tmp_path):
    """`fw export` of a checkpoint holds about one tensor at a time: its peak above where it
    started stays far below the model it writes, and what it writes is the model."""
    from framework.checkpoint.export import consolidated_state
    from framework.cli import main
    from framework.memory import peak_rss, reset_peak_rss

    run = tmp_path / "run"
    train(run, "strategy=tensor", "trainer.devices=2", "trainer.max_steps=2")
    ckpt = run / "checkpoints" / "step00000002"
    out = tmp_path / "model.pt"
    main(["export", str(ckpt), str(tmp_path / "warm.pt")])  # imports paid before measuring
    start = reset_peak_rss()
    assert main(["export", str(ckpt), str(out)]) == 0
    rise = peak_rss() - start
    model = parameters() * 4
    print(f"\nexport: peak +{rise >> 20} MiB for a {model >> 20} MiB model")
    assert rise < 0.5 * model, (rise, model)
    written = torch.load(out, weights_only=True)
    want = consolidated_state(ckpt)
    assert written.keys() == want.keys() and all(torch.equal(written[k], want[k]) for k in want)


def llama_dir(root: Path) -> Path:
    """A pretrained Llama of ~13 M parameters (50 MiB of fp32 weights), written here."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=8,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(root / "llama", max_shard_size="20MB")
    return root / "llama"


def test_zero3_reads_only_its_partitions_of_pretrained_weights(tmp_path):
    """Under zero3 x2 a pretrained model is built on meta and each rank reads only its
    partitions: the kernel counts about half the weights read by each rank (a whole load per
    rank reads all of them), and its high-water mark stays within half the weights of the same
    job from a random init."""
    directory = llama_dir(tmp_path)
    weights = sum(f.stat().st_size for f in directory.glob("*.safetensors"))
    config = json.loads((directory / "config.json").read_text())
    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    init = ["experiment=hf_lm_tiny", *(f"task.model.config.{k}={config[k]}" for k in keys)]
    init.append(f"task.model.config.num_key_value_heads={config['num_key_value_heads']}")
    common = ["strategy=zero3", "trainer.devices=2", "trainer.max_steps=1", *QUIET, PROBE]
    common += ["task.data.max_bytes=100000", "task.data.batch_size=2", "task.data.block_size=32"]
    common += ["task.data.tokenizer=bytes", "logger=[csv]", "trainer.limit_val_batches=0"]
    for name, args in (
        ("random", init),
        ("pretrained", ["task=hf_lm", f"task.model.pretrained={directory}"]),
    ):
        result = fw(
            "train", *common, *args, f"+callbacks.peak.out={tmp_path / name}",
            f"run.dir={tmp_path / name / 'run'}", cwd=tmp_path, timeout=600,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
    for rank in (0, 1):
        path = tmp_path / "pretrained" / "run" / "pretrained" / f"rank{rank}.json"
        (report,) = json.loads(path.read_text())
        assert abs(report["local_bytes"] - weights / 2) < 0.05 * weights, (report, weights)
        assert report["io_read"] <= report["local_bytes"] + 256 * 1024, (report, weights)
    pretrained, random = peaks(tmp_path / "pretrained", 2), peaks(tmp_path / "random", 2)
    extra = [p - r for p, r in zip(pretrained, random, strict=True)]
    print(
        f"\nzero3 pretrained: extra per rank {[e >> 20 for e in extra]} MiB, weights {weights >> 20} MiB"
    )
    assert all(e < 0.5 * weights for e in extra), (extra, weights)
    shutil.rmtree(directory)
