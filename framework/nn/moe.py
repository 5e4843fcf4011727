"""Mixture-of-experts blocks: a top-k router, stacked experts, token dispatch (local or all-to-all
over the expert-parallel ranks) and a transformer block that uses them.

A model built from these runs unchanged under any expert-parallel degree: the parallel strategy
gives every `MoE` module its expert-parallel process group (`MoE.set_expert_parallel`) and keeps
only this rank's experts; the routing, the numbers of tokens per expert and the expert bias are
the same for any degree, so are the losses (dropless routing, fp32 scores).

- `TopKRouter`: scores in fp32 (softmax or sigmoid), top-k experts per token. An optional expert
  bias only *selects* experts (the gate weights come from the unbiased scores), updated once per
  optimizer step towards equal load (DeepSeek-V3's auxiliary-loss-free balancing); optional
  Switch-style load-balancing loss and router z-loss.
- `GroupedExperts`: E SwiGLU experts with weights stacked `(E, ...)`; the expert GEMMs run through
  `torch.nn.functional.grouped_mm` where dtype and strides allow it, else expert by expert.
- `MoE`: router + experts (+ optional shared experts), dropless by default, or with a capacity
  per expert (`capacity_factor`) beyond which tokens are dropped (they pass through as zeros).
- `ExpertDispatch` (what every MoE layer shares: the sort by expert, the all-to-all, the
  combine) and `LoadCounter` (what balancing and the metrics read of a router): also the base of
  transformers' sparse MoE blocks as swapped by framework.integrations.hf.sparse_moe.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from framework.nn.blocks import Attention, LayerNorm

SCORES = ("softmax", "sigmoid")
ROUTINGS = ("learned", "round_robin")
GEMMS = ("auto", "grouped", "loop")


def in_recompute() -> bool:
    """Whether this forward runs inside a backward pass (activation checkpointing's recompute)."""
    return torch._C._current_graph_task_id() != -1


class LoadCounter(nn.Module):
    """What balancing and the metrics read of a router: the tokens each expert received since
    the last optimizer step, the router's entropy, its auxiliary loss (no parameters, nothing in
    the state dict)."""

    aux_loss_coeff = 0.0
    z_loss_coeff = 0.0

    def __init__(self, num_experts: int, like: torch.Tensor | None = None) -> None:
        super().__init__()
        self.num_experts = num_experts
        # tokens routed to each expert since the last optimizer step (this rank's tokens); made
        # as `like` is (a fake tensor in fw check's simulation) unless that is on meta
        zeros = like.new_zeros(num_experts, dtype=torch.float32) if like is not None else None
        if zeros is None or zeros.is_meta:
            zeros = torch.zeros(num_experts)
        self.register_buffer("tokens_per_expert", zeros, persistent=False)
        self.aux_loss = torch.zeros(())
        self.stats: dict[str, torch.Tensor] = {}
        self.counting = True  # off while a pipeline infers shapes with a trial forward

    def count(self, chosen: torch.Tensor, probabilities: torch.Tensor) -> torch.Tensor:
        """Tokens per expert of `chosen` [T, k]; added to the step's counts once per token
        in training (not again by activation checkpointing's recompute)."""
        counts = torch.bincount(chosen.flatten(), minlength=self.num_experts).float()
        if self.training and self.counting and torch.is_grad_enabled() and not in_recompute():
            self.tokens_per_expert += counts
            with torch.no_grad():  # nothing saved for backward: recompute saves the same
                p = probabilities.detach()
                self.stats = {
                    "counts": counts,
                    "entropy": -(p * p.clamp_min(1e-20).log()).sum(-1).mean(),
                }
        return counts

    @torch.no_grad()
    def update_bias(self, global_counts: torch.Tensor) -> None:
        """Once per optimizer step, with the counts summed over the data ranks: a new count."""
        self.tokens_per_expert.zero_()


class TopKRouter(LoadCounter):
    """Top-k expert choice per token, from fp32 scores; keeps what balancing and metrics need."""

    def __init__(
        self,
        dim: int,
        num_experts: int,
        top_k: int = 2,
        score: str = "softmax",
        bias_update_rate: float = 0.0,
        aux_loss_coeff: float = 0.0,
        z_loss_coeff: float = 0.0,
        routing: str = "learned",
    ) -> None:
        super().__init__(num_experts)
        if routing not in ROUTINGS:
            raise ValueError(f"routing={routing!r} is not one of {ROUTINGS}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be between 1 and num_experts={num_experts}")
        if score not in SCORES:
            raise ValueError(f"score={score!r} is not one of {SCORES}")
        self.top_k = top_k
        self.score = score
        self.bias_update_rate = bias_update_rate
        self.aux_loss_coeff = aux_loss_coeff
        self.z_loss_coeff = z_loss_coeff
        self.routing = routing  # round_robin: token t to experts t..t+k-1 (mod E), for measuring
        self.gate = nn.Linear(dim, num_experts, bias=False)
        # selects experts only; moved towards equal load once per optimizer step (checkpointed)
        self.register_buffer("expert_bias", torch.zeros(num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate weights [T, k] in fp32 or wider, expert ids [T, k]) for tokens x [T, dim]."""
        dtype = torch.promote_types(x.dtype, torch.float32)  # fp32 at least (fp64 stays fp64)
        with no_autocast(x.device.type):  # autocast would run it in bf16 whatever its inputs
            logits = F.linear(x.to(dtype), self.gate.weight.to(dtype))
        scores = logits.softmax(-1) if self.score == "softmax" else logits.sigmoid()
        chosen = torch.topk(scores.detach() + self.expert_bias, self.top_k, dim=-1).indices
        if self.routing == "round_robin":  # balanced by construction (communication benchmarks)
            t = torch.arange(x.shape[0], device=x.device)[:, None]
            chosen = (t + torch.arange(self.top_k, device=x.device)) % self.num_experts
        weights = scores.gather(-1, chosen)
        if self.score == "sigmoid":
            weights = weights / weights.sum(-1, keepdim=True)
        counts = self.count(chosen, scores)
        self.aux_loss = self.balance_loss(logits, scores, counts)
        return weights, chosen

    def balance_loss(self, logits, scores, counts) -> torch.Tensor:
        """Switch-style load-balancing loss plus router z-loss, with their coefficients (0: off)."""
        loss = torch.zeros((), device=logits.device)
        if self.aux_loss_coeff:
            share = counts / counts.sum().clamp_min(1.0)  # f_e: fraction of assignments
            probability = (scores / scores.sum(-1, keepdim=True)).mean(0)  # P_e
            loss = loss + self.aux_loss_coeff * self.num_experts * (share * probability).sum()
        if self.z_loss_coeff:
            loss = loss + self.z_loss_coeff * torch.logsumexp(logits, -1).pow(2).mean()
        return loss

    @torch.no_grad()
    def update_bias(self, global_counts: torch.Tensor) -> None:
        """bias += rate * sign(mean load - load): under-used experts get picked more often."""
        if self.bias_update_rate:
            self.expert_bias += self.bias_update_rate * torch.sign(
                global_counts.mean() - global_counts
            )
        super().update_bias(global_counts)


def local_part(weight: torch.Tensor) -> torch.Tensor:
    """This rank's part of an expert weight (a DTensor under expert parallel), else itself."""
    return weight.to_local() if hasattr(weight, "to_local") else weight


def grouped_gemm_fits(x: torch.Tensor, dims: tuple[int, ...], gemm: str = "auto") -> bool:
    """Whether `grouped_mm` runs the expert GEMMs of x: fp32 or bf16, rows of every size in
    `dims` whose byte strides divide by 16 (gemm 'grouped' or 'loop' forces the choice)."""
    if gemm != "auto":
        return gemm == "grouped"
    size = x.element_size()
    return x.dtype in (torch.float32, torch.bfloat16) and all(d * size % 16 == 0 for d in dims)


def autocast_inputs(x: torch.Tensor, weights: list[torch.Tensor], dims, gemm: str):
    """x and the expert weights in autocast's dtype where grouped_mm will run them: it is not
    on autocast's list, so under bf16-mixed it would run in fp32 and miss the GPU's bf16 grouped
    GEMM; cast as autocast casts the per-expert loop's matmuls."""
    low = autocast_dtype(x.device.type)
    if low is not None and grouped_gemm_fits(x.to(low), dims, gemm):
        return x.to(low), [w.to(low) for w in weights]
    return x, weights


def expert_gemm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, grouped: bool):
    """Rows of x sorted by expert (`counts[e]` for expert e) times their expert's w[e].T."""
    if grouped:
        offs = torch.cumsum(counts, 0).to(torch.int32)
        return F.grouped_mm(x, w.transpose(-2, -1), offs=offs)
    outs = [rows @ w[e].t() for e, rows in enumerate(torch.split(x, counts.tolist()))]
    return torch.cat(outs) if outs else x.new_zeros(0, w.shape[1])


class GroupedExperts(nn.Module):
    """E SwiGLU experts: w1, w3 (E, hidden, dim) and w2 (E, dim, hidden), stacked."""

    weight_names = ("w1", "w2", "w3")  # the stacked weights expert parallel splits on dim 0

    def __init__(self, dim: int, hidden: int, num_experts: int, gemm: str = "auto") -> None:
        super().__init__()
        if gemm not in GEMMS:
            raise ValueError(f"gemm={gemm!r} is not one of {GEMMS}")
        self.num_experts = num_experts
        self.gemm = gemm
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        for w in (self.w1, self.w3, self.w2):
            nn.init.normal_(w, std=0.02)

    def use_grouped(self, x: torch.Tensor) -> bool:
        """grouped_mm where it runs: fp32 or bf16, rows whose byte strides divide by 16."""
        return grouped_gemm_fits(x, (self.w1.shape[-1], self.w1.shape[-2]), self.gemm)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Rows of x sorted by expert, `counts[e]` rows for this rank's expert e."""
        dims = (self.w1.shape[-1], self.w1.shape[-2])
        x, (w1, w3, w2) = autocast_inputs(
            x, [local_part(w) for w in (self.w1, self.w3, self.w2)], dims, self.gemm
        )
        grouped = self.use_grouped(x)
        h = F.silu(expert_gemm(x, w1, counts, grouped)) * expert_gemm(x, w3, counts, grouped)
        return expert_gemm(h, w2, counts, grouped)


class ExpertDispatch(nn.Module):
    """What every mixture-of-experts layer shares: tokens sorted by their chosen experts, run by
    `self.experts(rows, counts)` (here, or over the expert-parallel ranks by all-to-all), and
    combined with their gate weights. A layer sets `num_experts`, `router` (a LoadCounter) and
    `experts` (a module with `weight_names`, its stacked (E, ...) weights)."""

    def __init__(self, num_experts: int, capacity_factor: float | None = None) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.capacity_factor = capacity_factor
        self.ep_group = None  # expert-parallel process group (None: every expert here)
        self.ep_size = 1
        self.ep_rank = 0
        self.dropped = torch.zeros(())
        self.rows_sent = 0

    def set_expert_parallel(self, group, size: int, rank: int) -> None:
        """Run this rank's experts E/size * rank ... and exchange tokens over `group`."""
        if self.num_experts % size:
            raise ValueError(f"num_experts={self.num_experts} is not divisible by ep={size}")
        self.ep_group, self.ep_size, self.ep_rank = group, size, rank

    def dispatch(self, flat: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor):
        """sum over the k chosen experts e of weights[t, e] * E_e(flat[t]), for tokens [T, dim],
        in flat's dtype (the products and their sum in the gate weights' dtype)."""
        k = chosen.shape[-1]
        expert_of = chosen.flatten()
        order = torch.argsort(expert_of, stable=True)
        counts = torch.bincount(expert_of, minlength=self.num_experts)
        keep = self.capacity_mask(expert_of[order], counts)
        if keep is not None:
            order = order[keep]
            counts = torch.bincount(expert_of[order], minlength=self.num_experts)
        rows = flat[order // k]
        out_rows = self.run_experts(rows, counts)
        combined = flat.new_zeros(expert_of.numel(), flat.shape[-1], dtype=out_rows.dtype)
        combined[order] = out_rows
        y = (combined.view(-1, k, flat.shape[-1]).to(weights.dtype) * weights.unsqueeze(-1)).sum(1)
        return y.to(flat.dtype)

    def capacity_mask(self, sorted_experts: torch.Tensor, counts: torch.Tensor):
        """With a capacity factor: which of the expert-sorted assignments fit (None: all)."""
        if self.capacity_factor is None:
            self.dropped = torch.zeros(())
            return None
        total = sorted_experts.numel()
        capacity = math.ceil(self.capacity_factor * total / self.num_experts)
        starts = torch.cumsum(counts, 0) - counts
        position = torch.arange(total, device=counts.device) - starts[sorted_experts]
        keep = position < capacity
        self.dropped = (1.0 - keep.float().mean()).detach()
        return keep

    def run_experts(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Rows sorted by global expert -> their expert outputs (all-to-all under ep > 1)."""
        if self.ep_size == 1:
            self.rows_sent = 0
            return self.experts(rows, counts)
        from torch.distributed._functional_collectives import all_to_all_single

        local = self.num_experts // self.ep_size
        send = counts.view(self.ep_size, local).sum(1).tolist()
        received = all_to_all_single(counts, None, None, self.ep_group).view(self.ep_size, local)
        recv = received.sum(1).tolist()
        inbound = all_to_all_single(rows, recv, send, self.ep_group)
        # received rows come grouped by source rank, then expert: regroup them by expert
        expert_of = torch.repeat_interleave(
            torch.arange(local, device=rows.device).repeat(self.ep_size), received.flatten()
        )
        regroup = torch.argsort(expert_of, stable=True)
        done = self.experts(inbound[regroup], received.sum(0))
        back = torch.empty_like(done)
        back[regroup] = done
        self.rows_sent = sum(send) - send[self.ep_rank]
        return all_to_all_single(back, send, recv, self.ep_group)


class MoE(ExpertDispatch):
    """Router + experts (+ shared experts): y = shared(x) + sum over the k chosen e of w_e E_e(x)."""

    def __init__(
        self,
        dim: int,
        hidden: int,
        num_experts: int = 8,
        top_k: int = 2,
        shared_experts: int = 0,
        score: str = "softmax",
        capacity_factor: float | None = None,
        bias_update_rate: float = 1e-3,
        aux_loss_coeff: float = 0.0,
        z_loss_coeff: float = 0.0,
        gemm: str = "auto",
        routing: str = "learned",
    ) -> None:
        super().__init__(num_experts, capacity_factor)
        self.router = TopKRouter(
            dim, num_experts, top_k, score, bias_update_rate, aux_loss_coeff, z_loss_coeff, routing
        )
        self.experts = GroupedExperts(dim, hidden, num_experts, gemm)
        self.shared = SwiGLU(dim, hidden * shared_experts) if shared_experts else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights, chosen = self.router(flat)
        y = self.dispatch(flat, weights, chosen)
        if self.shared is not None:
            y = y + self.shared(flat)
        return y.view_as(x)


class SwiGLU(nn.Module):
    """The shared expert: silu(x w1) * (x w3) then w2."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoETransformerBlock(nn.Module):
    """Pre-norm block whose MLP is a mixture of experts: x + attn(ln1(x)), then x + moe(ln2(x)).

    Attention is split by heads under tensor parallel as in TransformerBlock; the experts are not
    tensor-split (each tensor-parallel rank runs them whole), they are split over `ep`.
    """

    def __init__(self, n_embd: int, n_head: int, moe: dict[str, Any], dropout: float = 0.0) -> None:
        super().__init__()
        self.ln1 = LayerNorm(n_embd)
        self.attn = Attention(n_embd, n_head, dropout)
        self.ln2 = LayerNorm(n_embd)
        self.moe = MoE(n_embd, **moe)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.moe(self.ln2(x))


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The lower precision autocast runs matmuls in here, or None when it is off."""
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def no_autocast(device_type: str):
    """Autocast off for the enclosed ops where it can be on (not on the meta device, which has
    none): the router's scores are fp32 as documented, also under bf16-mixed and 16-mixed."""
    if torch.amp.is_autocast_available(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()
