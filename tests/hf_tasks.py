"""A plain LightningModule around a transformers model, its data, and a probe of its FSDP units.

Apart from tests/tasks.py so that importing that module never imports transformers (the `hf`
extra); nothing here is downloaded: the model is a random init from a config written here.
"""

from __future__ import annotations

import json
import os

import lightning.pytorch as pl
import torch


class PlainLlama(pl.LightningModule):
    """A Lightning user's causal LM: a random-init `LlamaForCausalLM` (seeded by the framework
    before it is built), its own loss (transformers' shifted cross-entropy) and optimizer."""

    family = ("LlamaConfig", "LlamaForCausalLM")
    extra: dict = {}  # config settings of the family

    def __init__(
        self,
        hidden: int = 64,
        layers: int = 2,
        heads: int = 4,
        kv_heads: int = 2,
        vocab: int = 256,
        lr: float = 1e-3,
    ) -> None:
        super().__init__()
        import transformers

        config_class, model_class = (getattr(transformers, n) for n in self.family)
        self.lr = lr
        config = config_class(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            max_position_embeddings=64,
            **self.extra,
        )
        self.lm = model_class(config)

    def training_step(self, batch, batch_idx):
        loss = self.lm(input_ids=batch, labels=batch).loss
        self.log("train/loss", loss, sync_dist=True)  # the mean over ranks, as one process
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class PlainQwen2(PlainLlama):
    """The same user task around a `Qwen2ForCausalLM`: biased q/k/v projections, and its input
    embedding tied to the LM head, as the small Qwen2 models ship."""

    family = ("Qwen2Config", "Qwen2ForCausalLM")
    extra = {"tie_word_embeddings": True}


class PlainQwen3(PlainLlama):
    """The same user task around a dense `Qwen3ForCausalLM`: per-head RMSNorms of the queries
    and keys (q_norm, k_norm), whose plan style is `replicated_with_grad_allreduce`."""

    family = ("Qwen3Config", "Qwen3ForCausalLM")
    extra = {"head_dim": 16}


class PlainBert(pl.LightningModule):
    """The most common transformers job: a `BertForSequenceClassification` fine-tune in a plain
    LightningModule (random init, no download). transformers declares no tensor-parallel plan
    for BERT; no dropout (a split activation draws its own mask on each rank)."""

    def __init__(
        self, hidden: int = 64, layers: int = 2, heads: int = 4, vocab: int = 256, lr: float = 1e-3
    ) -> None:
        super().__init__()
        import transformers

        self.lr = lr
        config = transformers.BertConfig(
            vocab_size=vocab,
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            intermediate_size=2 * hidden,
            max_position_embeddings=64,
            num_labels=2,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
        self.bert = transformers.BertForSequenceClassification(config)

    def training_step(self, batch, batch_idx):
        tokens, labels = batch
        loss = self.bert(input_ids=tokens, labels=labels).loss
        self.log("train/loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class LabelledTokens(pl.LightningDataModule):
    """Random token sequences (seed 0) labelled by whether their first token is even."""

    def __init__(self, batch_size: int = 8, length: int = 16, vocab: int = 256) -> None:
        super().__init__()
        self.batch_size, self.length, self.vocab = batch_size, length, vocab

    def setup(self, stage=None) -> None:
        generator = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, self.vocab, (512, self.length), generator=generator)
        self.train_set = torch.utils.data.TensorDataset(tokens, tokens[:, 0] % 2)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)


class RandomTokens(pl.LightningDataModule):
    """Sequences of random tokens (seed 0), in memory, loaded as Lightning's docs teach."""

    def __init__(self, batch_size: int = 8, length: int = 16, vocab: int = 256) -> None:
        super().__init__()
        self.batch_size, self.length, self.vocab = batch_size, length, vocab

    def setup(self, stage=None) -> None:
        generator = torch.Generator().manual_seed(0)
        self.train_set = torch.randint(0, self.vocab, (512, self.length), generator=generator)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)


class FSDPUnits(pl.Callback):
    """Writes, per rank, the classes FSDP2 made sharding units (named FSDP<class> by torch)."""

    def __init__(self, out: str) -> None:
        self.out = out

    def on_train_start(self, trainer, pl_module) -> None:
        units = sorted(
            type(m).__name__.removeprefix("FSDP")
            for m in pl_module.modules()
            if type(m).__name__.startswith("FSDP")
        )
        with open(os.path.join(self.out, f"units-rank{trainer.global_rank}.json"), "w") as fh:
            json.dump(units, fh)


class HiddenPositions(pl.Callback):
    """Writes, per rank, how many positions of each sequence the decoder layers hand on (their
    output's dimension 1) at the first step: the whole sequence, or this rank's share of it."""

    def __init__(self, out: str) -> None:
        self.out = out
        self.seen: dict[str, int] = {}

    def on_train_start(self, trainer, pl_module) -> None:
        for name, module in pl_module.named_modules():
            if type(module).__name__.endswith("DecoderLayer"):
                module.register_forward_hook(self._record(name))

    def _record(self, name: str):
        def hook(module, args, output) -> None:
            hidden = output[0] if isinstance(output, tuple) else output
            self.seen.setdefault(name, hidden.shape[1])

        return hook

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == 1:
            path = os.path.join(self.out, f"positions-rank{trainer.global_rank}.json")
            with open(path, "w") as fh:
                json.dump(self.seen, fh)
