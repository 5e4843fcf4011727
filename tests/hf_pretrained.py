"""Pretrained directories written by the tests (nothing is downloaded): a tiny Llama saved with
`save_pretrained` in several safetensors files with an index, a word-level tokenizer, and a
corpus whose every training window is the same, so a first step's loss can be computed here."""

from __future__ import annotations

import os
import random
from pathlib import Path

import lightning.pytorch as pl

BLOCK = 32  # task.data.block_size of the runs that use `periodic_corpus`


def write_llama(
    directory: Path, vocab: int = 300, max_shard_size: str = "60KB", tied: bool = False
) -> Path:
    """A random-init tiny Llama (seed 0; its head tied to the embedding when `tied`, then saved
    once, under the embedding's name) in safetensors files of at most `max_shard_size`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )
    LlamaForCausalLM(config).save_pretrained(directory, max_shard_size=max_shard_size)
    return directory


def write_moe(directory: Path, family: str, vocab: int = 300, experts: int = 4) -> Path:
    """A random-init tiny MoE model (seed 0; `family` qwen3_moe or mixtral, `experts` per layer
    of which 2 are chosen) saved by `save_pretrained` as transformers writes such models: one
    tensor per expert (e.g. `mlp.experts.3.gate_proj.weight`), several files with an index."""
    import torch
    from transformers import MixtralForCausalLM, Qwen3MoeForCausalLM

    from tests.hf_moe_tasks import mixtral_config, qwen3_moe_config

    torch.manual_seed(0)
    if family == "qwen3_moe":
        model = Qwen3MoeForCausalLM(qwen3_moe_config(vocab=vocab, experts=experts))
    else:
        model = MixtralForCausalLM(mixtral_config(vocab=vocab, experts=experts))
    model.save_pretrained(directory, max_shard_size="60KB")
    return directory


def periodic_corpus(path: Path, length: int = 20_000) -> bytes:
    """A text file repeating one random line of BLOCK printable bytes: every window of BLOCK + 1
    bytes the data module cuts (any sample, any rank) is the same, returned here."""
    rng = random.Random(0)
    period = bytes(rng.randrange(33, 127) for _ in range(BLOCK))
    path.write_bytes(period * (length // BLOCK))
    return (period * 2)[: BLOCK + 1]


def reference_loss(directory: Path, window: bytes) -> float:
    """The causal-LM loss of `window` (input: all but the last byte) under
    `AutoModelForCausalLM.from_pretrained(directory)` in this process, fp32."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    ids = torch.tensor([list(window)])
    with torch.no_grad():
        logits = model(input_ids=ids[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits[0], ids[0, 1:]).item()


def write_word_tokenizer(directory: Path, words: list[str]) -> int:
    """A word-level tokenizer.json over `words` (whitespace split, [UNK] first); its size."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(sorted(set(words)))}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    return len(vocab)


# ---- run directories shared by the export and resume tests (tests/distributed/test_hf_*.py)

PLAIN = [  # a plain LightningModule around a transformers model, on random tokens
    "task=digits",
    "~task.model.dropout",
    "task.model.hidden=64",
    "task.data._target_=tests.hf_tasks.RandomTokens",
    "~task.data.val_fraction",
    "trainer.max_steps=3",
    "trainer.log_every_n_steps=1",
    "callbacks.checkpoint.every_n_steps=3",
    "logger=[csv]",
    "trainer.enable_progress_bar=false",
    "trainer.enable_model_summary=false",
]
LLAMA = "task._target_=tests.hf_tasks.PlainLlama"
QWEN3_MOE = "task._target_=tests.hf_moe_tasks.PlainMoE"
# 2 processes, 3 steps, a checkpoint at step 3, a global batch of 8 sequences (tensor and
# pipeline ranks share each batch; a data-parallel rank takes 4 of them); the fsdp run goes
# on to step 6 (checkpoint at 6): the uninterrupted run a checkpoint moved from tensor=2 follows.
# Each but the pipeline writes its trained model's logits on fixed tokens (FinalLogits): what
# an export of its checkpoint must give.
LOGITS = "+callbacks.logits._target_=tests.hf_pretrained.FinalLogits"
RUNS = {
    "tensor": ["strategy=tensor", LLAMA, "task.data.batch_size=8", LOGITS],
    "fsdp": ["strategy=fsdp", LLAMA, "task.data.batch_size=4", "trainer.max_steps=6", LOGITS],
    "pipeline": ["strategy=pipeline", LLAMA, "task.data.batch_size=8"],
    "expert": ["strategy=expert", QWEN3_MOE, "task.data.batch_size=4", LOGITS],
    "zero3": ["strategy=zero3", LLAMA, "task.data.batch_size=4", LOGITS],
}


def shared_runs(tmp_path_factory, names) -> dict[str, Path]:
    """Run directories of RUNS (2 processes each) and a digits run (no transformers model), made
    once per test session whichever module asks first (a lock and a marker per run, as the
    one-process references of tests/distributed/conftest.py)."""
    import fcntl

    from tests.conftest import QUIET, fw

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    root = root / "hf_runs"
    root.mkdir(exist_ok=True)
    jobs = {name: [*PLAIN, *args, "trainer.devices=2"] for name, args in RUNS.items()}
    jobs["digits"] = ["task=digits", "task.model.hidden=16", "trainer.max_steps=1", *QUIET]
    jobs["digits"].append("callbacks.checkpoint.every_n_steps=1")
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for name in names:
            if not (root / f".{name}.done").exists():
                result = fw("train", *jobs[name], f"run.dir={name}", cwd=root)
                assert result.returncode == 0, result.stderr[-3000:]
                (root / f".{name}.done").touch()
    return {name: root / name for name in names}


def logit_tokens():
    """The tokens the trained model's logits are taken on (FinalLogits, and the export tests)."""
    import torch

    return torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))


class FinalLogits(pl.Callback):
    """At the end of training, every rank runs the task's model (`lm`) on `logit_tokens()` as
    the strategy holds it (sharded, split, partitioned), and rank 0 writes the logits to
    <run dir>/final_logits.pt: the trained model's own output, which an export must reproduce."""

    def on_train_end(self, trainer, pl_module) -> None:
        import torch

        pl_module.eval()
        with torch.no_grad():
            logits = pl_module.lm(logit_tokens().to(pl_module.device)).logits
        logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
        if trainer.is_global_zero:
            torch.save(logits.cpu(), Path(trainer.default_root_dir) / "final_logits.pt")
        pl_module.train()
