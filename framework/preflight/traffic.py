"""Bytes one rank sends per optimizer step under a checked layout, by the group that sends them
(`fw plan`'s bytes column, `fw check`'s sent line, and the facts the performance model takes,
framework/preflight/perf.py).

The standard per-rank volumes of one optimizer step (ring collectives, the (N-1)/N factor left
out): data parallel all-reduces the gradients (2Ψ, Ψ the gradient bytes), ZeRO-1/2 reduce-scatter
them and all-gather the updated parameters (2Ψ), ZeRO-3 and FSDP gather the parameters again for
backward (3Ψ), tensor parallel all-reduces activations twice in forward and twice in backward per
layer (4·b·s·h), a pipeline sends each microbatch's activations forward and their gradients back
at each stage boundary (2·b·s·h), mixture-of-experts layers all-to-all the routed tokens there
and back, forward and backward (4·b·s·k·h per layer), and a Muon optimizer gathers each sharded
hidden matrix whole on one rank and scatters the result back (twice the rank's shards of them,
framework/preflight/optimizer_work.py). Under context parallel (cp > 1) a rank holds
s/cp positions of each sequence, and its attention sends K/V each layer by `strategy.cp_mode`
(`context_bytes`: the bytes that leave the rank, forward and backward). The data-parallel bytes
and the degrees come from the strategy plugin (`data_traffic`, `mesh_dims`:
framework.plugins.StrategyCapabilities).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig

if TYPE_CHECKING:
    from framework.preflight.report import CheckReport
    from framework.preflight.simulate import RankMemory


def comm_bytes(cfg: DictConfig, report: CheckReport) -> float:
    """Bytes one rank sends per optimizer step under this layout (see the module docstring)."""
    return float(sum(traffic(cfg, report).values()))


def degrees_of(report: CheckReport) -> Any:
    """The layout's degrees on one mesh (None: a whole replica per process)."""
    return report.plan.dims


def traffic(cfg: DictConfig, report: CheckReport) -> dict[str, float]:
    """Bytes one rank sends per optimizer step, by the group that sends them: `data` (the
    plugin's data-parallel bytes), `tensor`, `pipeline`, `experts`, `context` (the module
    docstring), and `optimizer` (Muon's exchange of whole matrices); of the rank with the most
    gradients and parameters, and the most the optimizer step sends."""
    sent = max(r.optimizer_sent for r in report.ranks)
    return sent_by(cfg, report, *largest_states(report), sent)


def largest_states(report: CheckReport) -> tuple[int, int]:
    """The most gradient bytes and the most parameter bytes a checked rank holds."""
    return max(r.grads for r in report.ranks), max(r.params for r in report.ranks)


def rank_traffic(cfg: DictConfig, report: CheckReport, rank: RankMemory) -> dict[str, float]:
    """`traffic` of one checked rank, whose own gradients and parameters the data-parallel
    group reduces and gathers (`fw check`'s sent column)."""
    return sent_by(cfg, report, rank.grads, rank.params, rank.optimizer_sent)


def sent_by(
    cfg: DictConfig, report: CheckReport, grads: int, params: int, optimizer: float = 0.0
) -> dict[str, float]:
    from framework.plugins import capability

    plugin, strategy, world = report.plugin, report.strategy, report.world
    dims = degrees_of(report)
    degrees = {"pp": dims.pp, "tp": dims.tp} if dims is not None else {"pp": 1, "tp": 1}
    cp = dims.cp if dims is not None else 1
    data = capability(plugin, "data_traffic")(strategy, world, grads, params)
    model = dict(cfg.task.get("model") or {})
    act = activation_bytes(cfg) / cp  # a cp rank holds s/cp positions of each sequence
    n_layer = int(model.get("n_layer", 0))
    sent = {"data": float(data), "tensor": 0.0, "pipeline": 0.0, "experts": 0.0, "context": 0.0,
            "optimizer": float(optimizer)}  # fmt: skip
    if cp > 1:
        sent["context"] = context_traffic(cfg, strategy.cp_mode, cp, degrees["tp"]) / degrees["pp"]
    if degrees["tp"] > 1:
        sent["tensor"] = 4 * act * n_layer / degrees["pp"]
    if degrees["pp"] > 1:
        sent["pipeline"] = 2 * act
    if "num_experts" in model:
        sent["experts"] = 4 * act * int(model.get("top_k", 1)) * n_layer / degrees["pp"]
    return sent


def context_bytes(
    mode: str, cp: int, rows: int, seq: int, heads: int, kv_heads: int, head_dim: int,
    element: int,
) -> tuple[float, float]:  # fmt: skip
    """(Forward, backward) bytes one rank's context-parallel attention sends per layer per step
    (framework/parallel/context/__init__.py), for `rows` sequences of `seq` positions, `heads` query and
    `kv_heads` key/value heads of `head_dim` on the rank, `element` bytes per value. A block is
    one rank's K and V: 2·b·s/cp·h_kv·d values.
    - ring: forward passes a block on cp-1 times, (cp-1)·2·b·s/cp·h_kv·d; backward passes each
      block again with its gradient (cp-1 times) and hands the gradient back (once);
    - allgather: the blocks all-gathered once, the same bytes as ring's forward; backward
      reduce-scatters their gradients ((cp-1)/cp of the cp blocks leave the rank);
    - ulysses: 4 all-to-alls of b·s/cp·h·d (q, k, v to heads, the output back; K/V heads
      repeated to h), forward and again backward, (cp-1)/cp of each leaving the rank.
    Gradients travel in fp32 at least (the merge accumulates in the softmax statistics' dtype).
    """
    if cp <= 1:
        return 0.0, 0.0
    block = 2 * rows * (seq // cp) * kv_heads * head_dim
    grad = max(element, 4)
    if mode == "ring":
        return float((cp - 1) * block * element), float((2 * cp - 1) * block * grad)
    if mode == "allgather":
        return float((cp - 1) * block * element), float((cp - 1) * block * grad)
    part = rows * (seq // cp) * heads * head_dim * element * (cp - 1) / cp
    return 4 * part, 4 * part


def attention_shape(cfg: DictConfig) -> dict[str, int]:
    """layers, heads, kv_heads, head_dim and seq of the task's model from its config: a
    framework.nn gpt's names (n_layer, n_head, n_embd, block_size) or a transformers config's
    (task.model.config: num_hidden_layers, num_attention_heads, ...; task.data.block_size);
    zeros where the config does not say."""
    model = dict(cfg.task.get("model") or {})
    hf_config = dict(model.get("config") or {})
    layers = int(model.get("n_layer", hf_config.get("num_hidden_layers", 0)))
    heads = int(model.get("n_head", hf_config.get("num_attention_heads", 0)))
    kv_heads = int(model.get("n_kv_head", hf_config.get("num_key_value_heads") or heads))
    width = int(model.get("n_embd", hf_config.get("hidden_size", 0)))
    head_dim = int(hf_config.get("head_dim") or (width // heads if heads else 0))
    seq = int(model.get("block_size", cfg.task.data.get("block_size", 0)) or 0)
    return {"layers": layers, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
            "seq": seq}  # fmt: skip


def context_traffic(cfg: DictConfig, mode: str, cp: int, tp: int = 1) -> float:
    """Bytes one rank's context-parallel attention sends per optimizer step, every layer's
    forward and backward (tensor parallel splits the heads over tp)."""
    forward, backward, layers = context_per_layer(cfg, mode, cp, tp)
    return layers * (forward + backward)


def context_per_layer(cfg: DictConfig, mode: str, cp: int, tp: int = 1) -> tuple[float, float, int]:
    """(Forward, backward) K/V bytes one rank sends per layer per step (`context_bytes` of the
    task's attention shape, per-rank batch and precision), and the model's layers."""
    shape = attention_shape(cfg)
    rows = int(cfg.task.data.get("batch_size", 0))
    element = 2 if "16" in str(cfg.trainer.precision) else 4
    heads, kv_heads = shape["heads"] // tp, max(1, shape["kv_heads"] // tp)
    forward, backward = context_bytes(
        mode, cp, rows, shape["seq"], heads, kv_heads, shape["head_dim"], element
    )
    return forward, backward, shape["layers"]


def activation_bytes(cfg: DictConfig) -> int:
    """b x s x h of the per-rank batch, in the precision's bytes (2 under 16-bit, else 4)."""
    model = dict(cfg.task.get("model") or {})
    rows, seq = int(cfg.task.data.get("batch_size", 0)), int(model.get("block_size", 0))
    width = int(model.get("n_embd", 0))
    return rows * seq * width * (2 if "16" in str(cfg.trainer.precision) else 4)


def layout_facts(report: CheckReport, per_node: int) -> dict[str, Any]:
    """What the performance model (framework/preflight/perf.py) needs of one checked layout:
    degrees, group sizes, which groups cross nodes, bytes by group, collectives per step, the
    schedule, and the worst rank's model states."""
    from framework.plugins import capability

    cfg, world = report.config, report.world
    dims = degrees_of(report)
    n = world.world_size
    data_ranks = report.plan.data_parallel[1]
    tp = dims.tp if dims is not None else 1
    pp = dims.pp if dims is not None else 1
    ep = dims.ep if dims is not None else 1
    cp = dims.cp if dims is not None else 1
    micro = int(getattr(report.strategy, "microbatches", 1)) if pp > 1 else 1
    virtual = int(getattr(report.strategy, "virtual_stages", 1)) if pp > 1 else 1
    n_layer = int(dict(cfg.task.model).get("n_layer", 0))
    many = n > per_node
    worst = report.worst
    return {
        "tp": tp,
        "pp": pp,
        "world_size": n,
        "world_spans_nodes": many,
        "sequence_parallel": bool(getattr(report.strategy, "sequence_parallel", False)),
        "precision": str(cfg.trainer.precision),
        "data_ranks": data_ranks,
        "microbatches": micro,
        "virtual_stages": virtual,
        "traffic": traffic(cfg, report),
        "data_overlap": float(capability(report.plugin, "data_overlap")(report.strategy, world)),
        "data_collectives": data_collectives(report),
        "group_sizes": {
            "data": data_ranks,
            "tensor": tp,
            "experts": ep,
            "pipeline": pp,
            "context": cp,
        },
        # ranks are laid out pp, dp, fsdp, tp (tp innermost): a tensor group is adjacent
        "spans_nodes": {
            "data": many and data_ranks > 1 and n // pp > per_node,
            "tensor": tp > per_node,
            "experts": ep * tp > per_node,
            "pipeline": many and n // pp >= per_node,
            "context": cp * tp > per_node,  # a cp group's ranks are tp apart (dims.py)
        },
        "tensor_collectives": 4 * max(1, n_layer // pp) * micro,
        "expert_collectives": 4 * max(1, n_layer // pp) * micro,
        "pipeline_receives": pipeline_receives(pp, micro, virtual),
        "context_collectives": context_collectives(report, cp) * max(1, n_layer // pp) * micro,
        "state_bytes": {"params": worst.params, "grads": worst.grads, "optimizer": worst.optimizer},
        # the optimizer step's matmuls (Muon's Newton-Schulz) of the rank that runs the most
        **optimizer_matmuls(report),
        # each simulated rank's host calls per step (simulate.RankMemory.host; perf's host term)
        "host_counts": [r.host for r in report.ranks],
    }


def optimizer_matmuls(report: CheckReport) -> dict[str, Any]:
    """`optimizer_flops` (by dtype) and `optimizer_matmuls` of the checked rank whose optimizer
    step runs the most matmul FLOPs (Muon's Newton-Schulz; none for AdamW)."""
    rank = max(report.ranks, key=lambda r: sum(r.optimizer_flops.values()))
    return {
        "optimizer_flops": dict(rank.optimizer_flops),
        "optimizer_matmuls": rank.optimizer_matmuls,
    }


def data_collectives(report: CheckReport) -> int | None:
    """The blocking data-parallel collectives per step the strategy states for the rank with
    the most gradients and parameters (None: one per bucket, perf.data_calls)."""
    from framework.plugins import capability

    stated = capability(report.plugin, "data_collectives")
    return stated(report.strategy, report.world, *largest_states(report))


def pipeline_receives(pp: int, micro: int, virtual: int) -> int:
    """Blocking receives of the busiest pipeline rank in a step: each of its v stages receives
    every microbatch's activations (unless it is the first stage) and their gradients (unless it
    is the last). A middle rank waits 2·m·v times; with two ranks both are ends, so m·(2v - 1).
    The schedules do not wait on a send before going on (1f1b fuses each send with the receive
    that follows it), so a send costs its bytes and no latency of its own."""
    if pp <= 1:
        return 0
    return micro * (2 * virtual - 1) if pp == 2 else 2 * micro * virtual


def context_collectives(report: CheckReport, cp: int) -> int:
    """Collectives (or sends) of one layer's context-parallel attention in a step."""
    if cp <= 1:
        return 0
    mode = report.strategy.cp_mode
    return {"ring": 2 * cp - 1, "allgather": 2}.get(mode, 8)
