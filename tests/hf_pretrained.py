"""Pretrained directories written by the tests (nothing is downloaded): a tiny Llama saved with
`save_pretrained` in several safetensors files with an index, a word-level tokenizer, and a
corpus whose every training window is the same, so a first step's loss can be computed here."""

from __future__ import annotations

import random
from pathlib import Path

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
