"""No rank holds the whole training state while it resumes on another layout, loads pretrained
weights, or exports: measured from the processes themselves (the rise of their resident
high-water mark and the kernel's count of bytes read, in the reports a resume and a pretrained
load write), on a model big enough that a whole extra copy of its state is far above the noise
(a gpt of ~13 M parameters: 50 MiB of fp32 weights, 150 MiB of training state with AdamW's
moments)."""

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
    "trainer.log_every_n_steps=1",
    "logger=[csv]",
    "callbacks.checkpoint.every_n_steps=2",
]
FSDP2 = ["strategy=fsdp", "trainer.devices=2"]  # the resuming layout


def parameters() -> int:
    """Elements of the gpt above (built on meta: no memory)."""
    from omegaconf import OmegaConf

    from framework.config.compose import compose_config
    from framework.instantiate import build_task

    cfg = compose_config([a for a in GPT if not a.startswith(("trainer.enable", "+"))])
    with torch.device("meta"):
        task = build_task(OmegaConf.create(OmegaConf.to_container(cfg.task, resolve=True)))
    return sum(p.numel() for p in task.parameters())


def train(run: Path, *args: str) -> str:
    result = fw("train", *GPT, *args, f"run.dir={run}", cwd=run.parent, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stderr


@pytest.fixture(scope="module")
def tensor_run(tmp_path_factory) -> Path:
    """Two steps under tensor parallel on 2 processes (checkpoint at step 2): resumed under fsdp
    (in a copy) and exported."""
    run = tmp_path_factory.mktemp("tensor") / "run"
    train(run, "strategy=tensor", "trainer.devices=2", "trainer.max_steps=2")
    return run


@pytest.mark.parametrize(
    ("written", "moved"),
    [
        (["strategy=ddp", "trainer.devices=1"], True),
        (["strategy=tensor", "trainer.devices=2"], False),
        (["strategy=fsdp", "trainer.devices=2"], True),
    ],
    ids=["lightning-ddp1", "dcp-tensor2", "dcp-fsdp2"],
)
def test_a_resume_on_another_layout_reads_only_each_ranks_share(written, moved, tmp_path, request):
    """ddp's one file and tensor parallel's column/row DCP shards read under fsdp x2, and fsdp
    x2's shards read by ddp on one process (which keeps the whole state): as each rank's resume
    report measures it, its reading costs it, beyond what it keeps, far less than a quarter of
    the state, and the kernel counts about as many bytes read as it keeps (reading the whole
    state per rank, as before, costs the whole state and reads all of it)."""
    run = tmp_path / "run"
    if written[0] == "strategy=tensor":
        shutil.copytree(request.getfixturevalue("tensor_run"), run, symlinks=True)
    else:
        train(run, *written, "trainer.max_steps=2")
    target = ["strategy=ddp", "trainer.devices=1"] if written[0] == "strategy=fsdp" else FSDP2
    err = train(run, *target, "trainer.max_steps=3")
    assert_resumed(err, run, 3, moved=moved)  # dcp -> dcp at 2 processes: read as it is
    state = parameters() * 4 * 3  # fp32 weights and AdamW's two moments
    world = 1 if target[0] == "strategy=ddp" else 2
    for rank in range(world):
        phases = json.loads((run / "resume" / f"rank{rank}.json").read_text())
        held = sum(p["held"] for p in phases)
        cost = max(p["peak_rise"] - p["held"] for p in phases)
        read = sum(p["io_read"] for p in phases)
        print(f"\n{written[0]} -> {target[0]} rank {rank}: held {held >> 20} MiB, reading cost "
              f"+{cost >> 20} MiB, kernel read {read >> 20} MiB, state {state >> 20} MiB")  # fmt: skip
        assert abs(held - state / world) < 0.05 * state, (phases, state)
        assert cost < 0.25 * state, (phases, state)
        assert read < held + 0.05 * state, (phases, state)


def test_export_streams_one_tensor_at_a_time(tensor_run, tmp_path):
    """`fw export` of a checkpoint holds about one tensor at a time: its peak above where it
    started stays far below the model it writes, and what it writes is the model."""
    from framework.checkpoint.export import consolidated_state
    from framework.cli import main
    from framework.memory import peak_rss, reset_peak_rss

    ckpt = tensor_run / "checkpoints" / "step00000002"
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
    """Under zero3 x2 in bf16-mixed a pretrained model is built on meta and each rank reads only
    its partitions, straight into DeepSpeed's buffers: the kernel counts about half the weights
    read by each rank (a whole load per rank reads all of them), and the reading raises the
    rank's resident high-water mark by far less than the weights (a whole copy per rank, read
    and then partitioned, raises it by all of them). DeepSpeed's engine is handed the model
    already cut into ZeRO-3 partitions: a model it receives whole it casts to bf16 whole and, on
    a GPU, moves to the device whole on every rank. The whole job's high-water mark is not
    compared with a random init's: at this size it varies by about the weights from run to
    run."""
    directory = llama_dir(tmp_path)
    weights = sum(f.stat().st_size for f in directory.glob("*.safetensors"))
    common = ["strategy=zero3", "trainer.devices=2", "trainer.max_steps=1", *QUIET]
    common += [
        "trainer.precision=bf16-mixed",
        "+callbacks.engine._target_=tests.tasks.EngineInputs",
    ]
    common += [f"+callbacks.engine.out={tmp_path}"]
    common += ["task.data.max_bytes=100000", "task.data.batch_size=2", "task.data.block_size=32"]
    common += ["task.data.tokenizer=bytes", "logger=[csv]", "trainer.limit_val_batches=0"]
    result = fw(
        "train", *common, "task=hf_lm", f"task.model.pretrained={directory}",
        f"run.dir={tmp_path / 'run'}", cwd=tmp_path, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in (0, 1):
        (report,) = json.loads((tmp_path / "run" / "pretrained" / f"rank{rank}.json").read_text())
        print(
            f"\nzero3 pretrained rank {rank}: read {report['io_read'] >> 20} MiB, reading cost "
            f"+{report['peak_rise'] >> 20} MiB, weights {weights >> 20} MiB"
        )
        assert abs(report["local_bytes"] - weights / 2) < 0.05 * weights, (report, weights)
        assert report["io_read"] <= report["local_bytes"] + 256 * 1024, (report, weights)
        assert report["peak_rise"] < 0.25 * weights, (report, weights)
        engine = json.loads((tmp_path / f"engine-rank{rank}.json").read_text())
        assert engine["partitioned"] and engine["whole_bytes"] < 0.05 * weights, (engine, weights)
    shutil.rmtree(directory)
