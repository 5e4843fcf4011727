"""Train a byte-level GPT; at the end, write a sampled continuation to <run dir>/sample.txt
(`fw predict RUN_DIR` samples a continuation of each of the data module's prompts)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from framework import ConfigError, TaskModule
from framework.nn import cross_entropy
from recipes.gpt.model import GPT

log = logging.getLogger("framework.recipes.gpt")


class GPTTask(TaskModule):
    """Next-byte prediction; logs train/loss and val/loss (nats per byte)."""

    def __init__(
        self,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        block_size: int = 128,
        dropout: float = 0.0,
        vocab_size: int = 256,
        sample_prompt: str = "def main(",
        sample_length: int = 300,
        sample_temperature: float = 0.8,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = GPT(vocab_size, block_size, n_layer, n_head, n_embd, dropout)

    @staticmethod
    def validate_config(prefix: str, args: dict) -> None:
        n_embd, n_head = args.get("n_embd", 128), args.get("n_head", 4)
        if n_head < 1 or n_embd % n_head:
            raise ConfigError(
                f"{prefix}.n_head",
                n_head,
                f"must divide n_embd={n_embd}",
                [str(h) for h in range(1, n_embd + 1) if n_embd % h == 0][:12],
            )
        for key in ("n_layer", "block_size", "vocab_size"):
            if key in args and args[key] < 1:
                raise ConfigError(f"{prefix}.{key}", args[key], "must be at least 1")

    @staticmethod
    def tensor_parallel_dims(args: dict, sequence_parallel: bool = False) -> dict[str, int]:
        """Sizes the tensor-parallel degree splits: heads, the MLP's hidden width, the vocabulary
        (and the sequence, under sequence parallelism)."""
        dims = {
            "n_head": args.get("n_head", 4),
            "n_embd": args.get("n_embd", 128),
            "vocab_size": args.get("vocab_size", 256),
        }
        if sequence_parallel:
            dims["block_size"] = args.get("block_size", 128)
        return dims

    @staticmethod
    def context_parallel_dims(args: dict) -> dict[str, int]:
        """Sequence lengths context parallel splits into 2 x cp chunks."""
        return {"block_size": args.get("block_size", 128)}

    def param_groups(self):
        decay = [p for p in self.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.dim() < 2]
        return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def loss(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # F.cross_entropy's mean; under context parallel over the tokens of the whole sequences
        return cross_entropy(logits, y)

    def _loss(self, batch) -> torch.Tensor:
        x, y = batch
        return self.loss(self(x), y)

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train/loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val/loss", self._loss(batch), prog_bar=True, sync_dist=True)

    def test_step(self, batch, batch_idx):
        self.log("test/loss", self._loss(batch), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        """`fw predict`: a sampled continuation of each prompt of the batch (the data module's
        `prompts`), sample_length bytes, the same seed for each."""
        return [self.sample(prompt, self.hparams.sample_length) for prompt in batch]

    def sample(self, prompt: str, length: int, seed: int = 0) -> str:
        was_training = self.training
        self.eval()
        idx = torch.tensor([list(prompt.encode())], dtype=torch.long, device=self.device)
        gen = torch.Generator(device=self.device).manual_seed(seed)
        out = self.model.generate(idx, length, self.hparams.sample_temperature, generator=gen)
        self.train(was_training)
        return bytes(out[0].tolist()).decode("utf-8", errors="replace")

    def on_train_end(self) -> None:
        if self.hparams.sample_length <= 0:
            return
        if self.pipeline_stages is not None:
            log.info("No sample: under pipeline parallel no process holds the whole model.")
            return
        # Every rank samples (same seed, same text): under sharded strategies (ZeRO-3, FSDP) a
        # forward pass needs all processes to gather the parameters.
        text = self.sample(self.hparams.sample_prompt, self.hparams.sample_length)
        if not self.trainer.is_global_zero:
            return
        path = Path(self.trainer.default_root_dir) / "sample.txt"
        path.write_text(text)
        log.info("Sampled continuation (also in %s):\n%s\n%s\n%s", path, "-" * 60, text, "-" * 60)
