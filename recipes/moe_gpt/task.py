"""Train a byte-level mixture-of-experts GPT (next-byte prediction, as the gpt recipe)."""

from __future__ import annotations

from framework import ConfigError, TaskModule
from recipes.gpt.task import GPTTask
from recipes.moe_gpt.model import MoEGPT


class MoEGPTTask(GPTTask):
    """GPTTask with MoE blocks; the routers' auxiliary losses join the training loss."""

    def __init__(
        self,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        block_size: int = 128,
        dropout: float = 0.0,
        vocab_size: int = 256,
        num_experts: int = 8,
        top_k: int = 2,
        expert_hidden: int = 256,
        shared_experts: int = 0,
        score: str = "softmax",
        capacity_factor: float | None = None,
        bias_update_rate: float = 1e-3,
        aux_loss_coeff: float = 0.0,
        z_loss_coeff: float = 0.0,
        gemm: str = "auto",
        routing: str = "learned",
        sample_prompt: str = "def main(",
        sample_length: int = 300,
        sample_temperature: float = 0.8,
    ) -> None:
        TaskModule.__init__(self)  # not GPTTask's: it would build the dense model
        self.save_hyperparameters({k: v for k, v in locals().items() if k != "self"})
        moe = {
            "hidden": expert_hidden,
            "num_experts": num_experts,
            "top_k": top_k,
            "shared_experts": shared_experts,
            "score": score,
            "capacity_factor": capacity_factor,
            "bias_update_rate": bias_update_rate,
            "aux_loss_coeff": aux_loss_coeff,
            "z_loss_coeff": z_loss_coeff,
            "gemm": gemm,
            "routing": routing,
        }
        self.model = MoEGPT(vocab_size, block_size, n_layer, n_head, n_embd, moe, dropout)

    @staticmethod
    def validate_config(prefix: str, args: dict) -> None:
        GPTTask.validate_config(prefix, args)
        experts = args.get("num_experts", 8)
        if experts < 1:
            raise ConfigError(f"{prefix}.num_experts", experts, "must be at least 1")
        factor = args.get("capacity_factor")
        if factor is not None and not factor > 0:
            raise ConfigError(
                f"{prefix}.capacity_factor",
                factor,
                "must be greater than 0: each expert takes capacity_factor x its even share of "
                "the tokens, so 0 drops every token",
                hint="1.0 to 1.25 is usual; null takes every token (no limit).",
            )
        top_k = args.get("top_k", 2)
        if not 1 <= top_k <= experts:
            raise ConfigError(
                f"{prefix}.top_k", top_k, f"must be between 1 and num_experts={experts}"
            )

    def training_step(self, batch, batch_idx):
        x, y = batch
        task_loss = self.loss(self(x), y)
        self.log("train/loss", task_loss, prog_bar=True, sync_dist=True)
        return task_loss + self.model.aux_loss().to(task_loss.device)
