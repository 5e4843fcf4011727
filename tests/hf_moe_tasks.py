"""Plain LightningModules around tiny transformers MoE models (Qwen3-MoE, Mixtral), random init
from a config written here (nothing downloaded), and probes of their routing and gradients.

Apart from tests/tasks.py so that importing that module never imports transformers (the `hf`
extra). The data is tests.hf_tasks.RandomTokens.
"""

from __future__ import annotations

import json
import os

import lightning.pytorch as pl
import torch


def qwen3_moe_config(hidden: int = 64, experts: int = 4, vocab: int = 256, **extra):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        moe_intermediate_size=hidden // 2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        num_experts=experts,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        **extra,
    )


def mixtral_config(hidden: int = 64, experts: int = 4, vocab: int = 256, **extra):
    from transformers import MixtralConfig

    return MixtralConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden // 2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=experts,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        **extra,
    )


class PlainMoE(pl.LightningModule):
    """A Lightning user's causal LM: a random-init transformers MoE model (`family` qwen3_moe or
    mixtral, seeded by the framework before it is built), transformers' own loss, AdamW.
    `jitter`: Mixtral's router jitter noise (which expert parallel refuses); `router_logits`:
    the routers' auxiliary loss added to the loss (which a pipeline refuses)."""

    def __init__(
        self,
        family: str = "qwen3_moe",
        hidden: int = 64,
        experts: int = 4,
        vocab: int = 256,
        lr: float = 1e-3,
        norm_topk_prob: bool = True,
        jitter: float = 0.0,
        router_logits: bool = False,
    ) -> None:
        super().__init__()
        from transformers import MixtralForCausalLM, Qwen3MoeForCausalLM

        self.lr = lr
        if family == "qwen3_moe":
            config = qwen3_moe_config(
                hidden,
                experts,
                vocab,
                norm_topk_prob=norm_topk_prob,
                output_router_logits=router_logits,
            )
            self.lm = Qwen3MoeForCausalLM(config)
        elif family == "mixtral":
            config = mixtral_config(
                hidden,
                experts,
                vocab,
                router_jitter_noise=jitter,
                output_router_logits=router_logits,
            )
            self.lm = MixtralForCausalLM(config)
        else:
            raise ValueError(f"family={family!r} is not one of qwen3_moe, mixtral")

    def training_step(self, batch, batch_idx):
        loss = self.lm(input_ids=batch, labels=batch).loss
        self.log("train/loss", loss, sync_dist=True)  # the mean over ranks, as one process
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class RouterCounts(pl.Callback):
    """Per optimizer step, the tokens the model's own routers (transformers' TopKRouter modules,
    kept by the expert-parallel swap) sent to each expert, per layer, summed over all ranks;
    rank 0 writes them to `out`/router-counts.json (each token once: the ranks of a
    tensor-parallel group route the same tokens; a pipeline rank counts its stage's layers).
    Read from the routers' outputs, independently of the framework's own counts. Not for a
    pipeline's first step: torch's stages infer their shapes with one forward more."""

    def __init__(self, out: str) -> None:
        self.out = out
        self.steps: list[list[list[int]]] = []
        self.counts: torch.Tensor | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        config = pl_module.lm.config
        experts = getattr(config, "num_experts", None) or config.num_local_experts
        self.counts = torch.zeros(config.num_hidden_layers, experts, dtype=torch.long)
        for name, router in pl_module.named_modules():
            if type(router).__name__.endswith("TopKRouter"):
                layer = int(name.split(".layers.")[1].split(".")[0])
                router.register_forward_hook(self.hook(layer, experts))

    def hook(self, i: int, experts: int):
        def count(module, args, output) -> None:
            if module.training and torch.is_grad_enabled():
                chosen = output[2].flatten().cpu()
                self.counts[i] += torch.bincount(chosen, minlength=experts)

        return count

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        import torch.distributed as dist

        counts = self.counts.clone()
        if dist.is_initialized():
            dist.all_reduce(counts)
            dims = getattr(trainer.strategy, "dims", None)
            counts //= dims.tp if dims is not None else 1  # tp ranks: the same tokens
        self.steps.append(counts.tolist())
        self.counts.zero_()

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.global_rank == 0:
            with open(os.path.join(self.out, "router-counts.json"), "w") as fh:
                json.dump(self.steps, fh)


class GradNorms(pl.Callback):
    """The norm of every parameter's whole gradient at step 1, just before the optimizer step
    (after the strategy's gradient work: AdamW would hide a gradient off by a constant factor),
    to `out`/grad-norms.json (rank 0)."""

    def __init__(self, out: str) -> None:
        self.out = out

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.global_step != 1:
            return
        norms = {}
        for name, p in pl_module.named_parameters():
            if p.grad is not None:
                grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                norms[name] = float(grad.norm())
        if trainer.global_rank == 0:
            with open(os.path.join(self.out, "grad-norms.json"), "w") as fh:
                json.dump(norms, fh)
