"""A causal language model from transformers: pretrained from a local directory, or a random init
from a config dict. The parallel core splits it by the model's own plans (framework/integrations/hf/plans.py).

`pretrained=DIR` builds the model from DIR's config.json with its parameters on the meta device:
no process ever holds a whole copy it does not keep. Its weights are read once the strategy has
placed the model, each rank reading only what it keeps (framework/integrations/hf/pretrained.py):
the parallel strategies (fsdp, tensor, fsdp_tp, pipeline, explicit degrees) after they split it,
ZeRO-3 its partitions once DeepSpeed made them, and the strategies that keep the whole model
(ddp, diloco, hogwild, ZeRO-1/2) each tensor once, straight into the parameter. Either way before
a checkpoint is restored, so a resumed run continues from its checkpoint.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from framework import ConfigError, TaskModule
from framework.integrations.hf import pretrained as weights
from framework.nn.meta import parameters_on_meta

# task.model.arch -> transformers' config class of that family
ARCHS = {
    "llama": "LlamaConfig",
    "qwen2": "Qwen2Config",
    "qwen3_moe": "Qwen3MoeConfig",
    "mixtral": "MixtralConfig",
    "gpt2": "GPT2Config",
}


def offline() -> None:
    """Never any network access from transformers or huggingface_hub (read when imported)."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"


def build_model(arch: str, config: dict[str, Any] | None, pretrained: str | None):
    """The transformers causal LM: DIR's architecture with parameters on meta (weights read
    later), or a random init of `arch` with `config` (seeded by the framework before this)."""
    offline()
    import transformers

    if pretrained is not None:
        model_config = transformers.AutoConfig.from_pretrained(pretrained)
        with parameters_on_meta():
            return transformers.AutoModelForCausalLM.from_config(model_config)
    model_config = getattr(transformers, ARCHS[arch])(**(config or {}))
    return transformers.AutoModelForCausalLM.from_config(model_config)


class HFCausalLM(TaskModule):
    """Next-token prediction with a transformers causal LM; logs train/loss and val/loss (nats
    per token) with the model's own causal-LM loss."""

    def __init__(
        self,
        arch: str = "llama",
        config: dict[str, Any] | None = None,
        pretrained: str | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = build_model(arch, config, pretrained)

    @staticmethod
    def validate_config(prefix: str, args: dict) -> None:
        offline()
        weights.check_directory(f"{prefix}.pretrained", args.get("pretrained"))
        if args.get("pretrained") is not None:
            weights.check_readable(f"{prefix}.pretrained", args["pretrained"])
        arch = args.get("arch", "llama")
        if args.get("pretrained") is None and arch not in ARCHS:
            raise ConfigError(f"{prefix}.arch", arch, "is not a supported family", list(ARCHS))
        if args.get("pretrained") is None and not args.get("config"):
            raise ConfigError(
                f"{prefix}.config",
                args.get("config"),
                "is needed for a random init (or give a pretrained directory)",
                hint=f"Set {prefix}.pretrained=DIR, or {prefix}.config={{hidden_size: 64, ...}} "
                "(experiment=hf_lm_tiny sets a small one).",
            )
        if args.get("pretrained") is not None and args.get("config"):
            raise ConfigError(
                f"{prefix}.config",
                args["config"],
                "builds a random init; a pretrained model's config is its directory's "
                "config.json: give one of the two",
                ["null"],
            )

    def setup(self, stage: str) -> None:
        vocab = getattr(self.trainer.datamodule, "vocab_size", None)
        limit = self.model.config.get_text_config().vocab_size
        if vocab is not None and vocab > limit:
            raise ConfigError(
                "task.data.tokenizer",
                self.trainer.datamodule.tokenizer_name,
                f"has {vocab} tokens, more than the model's vocab_size={limit}",
            )

    def param_groups(self):
        decay = [p for p in self.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.dim() < 2]
        return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=idx).logits

    def loss(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """transformers' causal-LM loss with the targets already shifted (`y`: the next token
        of every position, as the data module gives them)."""
        vocab = logits.shape[-1]
        return self.model.loss_function(
            logits=logits, labels=None, shift_labels=y, vocab_size=vocab
        )

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

    @torch.no_grad()
    def predict_step(self, batch, batch_idx):
        """`fw predict`: a sampled continuation (64 tokens, temperature 0.8, top 50, the same
        seed for each) of each prompt of the batch (the data module's `prompts`), encoded and
        decoded with its tokenizer. Every rank runs every forward (sharded models gather)."""
        from framework.nn import full_tensor

        data = self.trainer.datamodule
        out = []
        for prompt in batch:
            idx = torch.tensor([data.encode(prompt)], dtype=torch.long, device=self.device)
            gen = torch.Generator(device=self.device).manual_seed(0)
            for _ in range(64):
                logits = full_tensor(self(idx))[:, -1, :] / 0.8
                kth = torch.topk(logits, min(50, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
                nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=gen)
                idx = torch.cat([idx, nxt], dim=1)
            out.append(data.decode(idx[0].tolist()))
        return out
