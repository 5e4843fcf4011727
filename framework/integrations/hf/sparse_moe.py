"""transformers' sparse mixture-of-experts blocks as framework MoE layers, for expert parallel.

A transformers MoE model says which of its modules are experts in its own expert-parallel plan
(`model.ep_plan`: its config's `base_model_ep_plan` under the base model's prefix, e.g.
`model.layers.*.mlp.experts: ep_dispatch_experts`, and `grouped_gemm` for the stacked weights
`gate_up_proj`, `down_proj` inside it). Under expert parallel (ep > 1) each such module's parent,
the sparse MoE block, is swapped for a `TransformersMoE` before the strategy parallelizes:

- the block's own router module, called as transformers calls it (softmax, top-k, the
  normalisation of the top-k weights, and the router logits transformers records for its
  auxiliary loss are the model's own);
- the same expert weight tensors under the same names (`...mlp.experts.gate_up_proj`,
  `...mlp.experts.down_proj`, `...mlp.gate.weight`), so checkpoints and a Hugging Face export read
  back by name;
- the framework's token dispatch (framework.nn.moe.ExpertDispatch: the all-to-all over the ep
  ranks) and load counts (callbacks.moe), as any framework.nn MoE layer.

It computes what transformers' block computes (within 1e-6 in fp32, tests/unit/test_hf_moe.py).
A block the swap would not reproduce is refused before launch: an ep plan style other than
those two, experts with biases, a custom gate, transposed or interleaved weights or a post-expert
norm, modules beside the router and the experts (shared experts), router jitter noise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from framework.errors import ConfigError
from framework.nn.moe import (
    ExpertDispatch,
    LoadCounter,
    autocast_inputs,
    expert_gemm,
    grouped_gemm_fits,
    local_part,
)

EP_STYLES = ("ep_dispatch_experts", "grouped_gemm")  # the experts module, its stacked weights
PACKED = ("gate_up_proj", "down_proj")
# the experts' layout transformers' `use_experts_implementation` records on them: the one
# PackedExperts computes (gate and up concatenated, (E, out, in) weights, no bias, no norm)
LAYOUT = {
    "has_gate": True,
    "is_concatenated": True,
    "is_transposed": False,
    "has_bias": False,
    "has_post_expert_norm": False,
}


class PackedExperts(nn.Module):
    """transformers' packed experts, computed from tokens sorted by expert: per expert e,
    down_proj[e] (act(gate) * up), with gate, up = the halves of gate_up_proj[e] x. Holds the
    model's own parameters (the same tensors, the same names) and activation."""

    weight_names = PACKED  # stacked (E, ...): expert parallel splits them on dim 0

    def __init__(self, experts: nn.Module) -> None:
        super().__init__()
        self.num_experts = experts.gate_up_proj.shape[0]
        self.gate_up_proj = experts.gate_up_proj
        self.down_proj = experts.down_proj
        self.act_fn = experts.act_fn

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Rows of x sorted by expert, `counts[e]` rows for this rank's expert e."""
        gate_up, down = local_part(self.gate_up_proj), local_part(self.down_proj)
        dims = (gate_up.shape[-1], gate_up.shape[-2], down.shape[-1])  # hidden, 2 x inter, inter
        x, (gate_up, down) = autocast_inputs(x.to(gate_up.dtype), [gate_up, down], dims, "auto")
        grouped = grouped_gemm_fits(x, dims)
        gate, up = expert_gemm(x, gate_up, counts, grouped).chunk(2, dim=-1)
        return expert_gemm(self.act_fn(gate) * up, down, counts, grouped)


class TransformersMoE(ExpertDispatch):
    """A transformers sparse MoE block (router + packed experts) on the framework's dispatch.
    The router keeps its name in the block (`gate` in Qwen3-MoE and Mixtral); `router` holds
    the load counts (no parameters: the state dict is the block's)."""

    def __init__(self, block: nn.Module, router_name: str) -> None:
        experts = PackedExperts(block.experts)
        super().__init__(experts.num_experts)
        self.router_name = router_name
        for name, child in block.named_children():  # in the block's order: the state dict's
            self.add_module(name, experts if name == "experts" else child)
        # its counts made like the weights: the swap may run inside fw check's fake tensors
        self.router = LoadCounter(experts.num_experts, like=experts.gate_up_proj)
        self.wrapped = type(block).__name__  # for messages and repr

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        flat = hidden.reshape(-1, hidden.shape[-1])
        logits, weights, chosen = getattr(self, self.router_name)(flat)
        with torch.no_grad():
            probabilities = logits.detach().float().softmax(-1)  # for the entropy metric
        self.router.count(chosen, probabilities)
        return self.dispatch(flat, weights, chosen).view_as(hidden)

    def extra_repr(self) -> str:
        return f"swapped={self.wrapped}, num_experts={self.num_experts}"


@dataclass(frozen=True)
class SparseBlock:
    """A transformers sparse MoE block that an ep plan names, found in a task."""

    path: str  # of the block in the task
    block: nn.Module
    router_name: str
    num_experts: int


def sparse_blocks(task: nn.Module, ep: int) -> list[SparseBlock]:
    """The sparse MoE blocks of the task's transformers models (the parents of the modules their
    `ep_plan` styles `ep_dispatch_experts`), each checked to be one the swap reproduces; a
    ConfigError names the first that is not. Blocks already swapped are not listed."""
    from framework.integrations.hf import plans
    from framework.parallel.keys import matches

    found: list[SparseBlock] = []
    for path, model in plans.models(task):
        plan = dict(getattr(model, "ep_plan", None) or {})
        for key, style in plan.items():
            if style not in EP_STYLES:
                refuse(_join(path, key), f"its ep plan gives it the style '{style}'", ep)
        keys = [k for k, style in plan.items() if style == "ep_dispatch_experts"]
        for name, module in model.named_modules():
            if not any(matches(k, name) for k in keys):
                continue
            block_name, _, attr = name.rpartition(".")
            block = model.get_submodule(block_name)
            if isinstance(block, TransformersMoE):
                continue
            where = _join(path, block_name)
            found.append(check_block(where, block, attr, module, ep))
    return found


def check_block(where: str, block: nn.Module, attr: str, experts: nn.Module, ep: int):
    """The block as SparseBlock, or a ConfigError saying what the swap would not reproduce."""
    kind = type(block).__name__
    if attr != "experts":
        refuse(where, f"({kind}) keeps its experts as '{attr}', not 'experts'", ep)
    for name in PACKED:
        weight = getattr(experts, name, None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 3:
            refuse(where, f"({kind}) has no stacked expert weight '{name}' (E, out, in)", ep)
    wrong = [k for k, v in LAYOUT.items() if getattr(experts, k, None) is not v]
    if wrong:
        refuse(where, f"({kind}) has experts with {', '.join(wrong)} not as {LAYOUT}", ep)
    gate = getattr(type(experts), "_apply_gate", None)
    if gate is None or gate.__name__ != "_default_apply_gate":
        refuse(where, f"({kind}) has experts with their own gate function", ep)
    others = [n for n, _ in block.named_children() if n != attr]
    if len(others) != 1 or others[0] == "router":
        refuse(where, f"({kind}) holds {others or 'no router'} beside its experts", ep)
    if getattr(block, "jitter_noise", 0.0):
        refuse(where, f"({kind}) multiplies its inputs by random router jitter noise", ep)
    return SparseBlock(where, block, others[0], experts.gate_up_proj.shape[0])


def refuse(where: str, problem: str, ep: int):
    raise ConfigError(
        "strategy.ep",
        ep,
        f"the transformers MoE block {where} {problem}, which the framework's expert parallel "
        "does not apply (it runs blocks of a router and packed SwiGLU experts, as Qwen3-MoE and "
        "Mixtral have)",
        [1],
        hint="Use ep=1 (the experts then stay whole on every rank under fsdp).",
    )


def swap_sparse_blocks(task: nn.Module, ep: int) -> list[TransformersMoE]:
    """Swap every transformers sparse MoE block of `task` for a TransformersMoE in place (same
    parameters, same names); returns the new layers (none when there is nothing to swap)."""
    swapped = []
    for found in sparse_blocks(task, ep):
        parent_name, _, attr = found.path.rpartition(".")
        layer = TransformersMoE(found.block, found.router_name)
        check_same_function(found, layer)
        setattr(task.get_submodule(parent_name), attr, layer)
        swapped.append(layer)
    return swapped


@torch.no_grad()
def check_same_function(found: SparseBlock, layer: TransformersMoE) -> None:
    """The swapped layer's output equals the block's own on a few random tokens (the block's
    forward may do what its structure does not show, e.g. scale its output); nothing to run
    while the weights have no values (meta, or fw check's fake tensors). No RNG state is used."""
    weight = layer.experts.gate_up_proj
    if weight.is_meta or type(weight).__name__ == "FakeTensor":
        return
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(1, 8, weight.shape[-1], generator=generator).to(weight.device, weight.dtype)
    modes = [(m, m.training) for m in (found.block, layer)]
    found.block.eval(), layer.eval()  # the same modules inside; no counting, no jitter
    try:
        want, got = found.block(x), layer(x)
    finally:
        for module, training in modes:
            module.train(training)
    want = want[0] if isinstance(want, tuple) else want
    if (got - want).abs().max() > 1e-3 * want.abs().max() + 1e-6:
        raise ConfigError(
            "strategy.ep",
            found.path,
            f"the transformers MoE block {found.path} ({layer.wrapped}) computes something "
            "else than its router and packed experts (checked on random tokens), which the "
            "framework's expert parallel would not reproduce",
            [1],
            hint="Use ep=1 for this model.",
        )


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name
