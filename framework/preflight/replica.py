"""What one whole replica computes in one optimizer step, counted once per plan for `fw plan`'s
step-time model (framework/preflight/perf.py): its FLOPs (torch's formulas, as
`framework.perf.flop_counter`; those of the fused attention kernels apart), the bytes the
other operations read and write, the operations launched, the optimizer step's launches and
the values the task logs with `sync_dist`. Counted on fake tensors on the per-rank batch; a
model whose shapes depend on its data (routed experts) on real tensors when small, else
estimated from its active parameters."""

from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger("framework.preflight")


@dataclass
class Work:
    """What one whole replica computes in one optimizer step on the per-rank batch."""

    flops: float
    other_bytes: float  # read and written by operations without a FLOP formula
    ops: int  # operations launched
    tokens: int  # token ids in the batch (0 when the input is not token ids)
    rows: int
    counted: str = "fake tensors"  # or how else the figures were found
    attention_flops: float = 0.0  # the part of `flops` the fused attention kernels compute
    synced_logs: int = 0  # values the step logs with sync_dist: one blocking all-reduce each
    optimizer_ops: int = 0  # operations the optimizer's step launches (0: not counted)
    other_ops: int = 0  # operations among `ops` whose bytes make `other_bytes`
    matmuls: int = 0  # operations among `ops` with a FLOP formula, the fused attention aside
    float8_flops: float = 0.0  # the part of `flops` float8 matmuls compute (trainer.float8)


def counting_mode():
    """A dispatch mode that counts FLOPs (torch's formulas, as `framework.perf.flop_counter`),
    the bytes other operations touch (and how many of those operations ran) and the
    operations launched."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves
    from torch.utils.flop_counter import flop_registry

    from framework.perf import register_flop_formulas

    register_flop_formulas()
    free = {"view", "_unsafe_view", "t", "transpose", "permute", "expand", "detach", "alias",
            "as_strided", "slice", "select", "unsqueeze", "squeeze", "split", "reshape",
            "empty", "zeros_like", "ones_like", "zero_", "fill_", "empty_like", "unbind",
            "split_with_sizes", "_to_copy", "lift_fresh"}  # fmt: skip

    class Counting(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.flops = self.bytes = 0
            self.attention_flops = self.float8_flops = 0
            self.ops = self.other_ops = self.matmuls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            if func.namespace == "prim":  # metadata (prim::device, asked of fake tensors only)
                return out
            packet = func._overloadpacket
            formula = flop_registry.get(packet)
            self.ops += 1
            if formula is not None:
                flops = formula(*args, **kwargs, out_val=out)
                self.flops += flops
                if is_attention(packet.__name__):
                    self.attention_flops += flops
                else:
                    self.matmuls += 1
                    if is_float8_matmul(packet.__name__, args):
                        self.float8_flops += flops
            elif packet.__name__ not in free:
                tensors = [t for t in tree_leaves((args, kwargs, out)) if torch.is_tensor(t)]
                self.bytes += sum(t.numel() * t.element_size() for t in tensors)
                self.other_ops += 1
            return out

    return Counting()


FLOAT8_MATMULS = {"_scaled_mm", "_scaled_grouped_mm"}  # float8 matmuls on a GPU


def is_float8_matmul(name: str, args) -> bool:
    """Whether a matmul runs in float8 on the GPU: torch's float8 kernels, or a matmul of
    torchao's float8 tensors (their `mm` dispatches `_scaled_mm`, which a mode outside it does
    not see), unless torchao emulates it (the CPU: ordinary matmuls)."""
    if name in FLOAT8_MATMULS:
        return True
    for a in args:
        config = getattr(a, "_linear_mm_config", None)
        if type(a).__name__ == "Float8TrainingTensor" and config is not None:
            return not config.output.emulate
    return False


def is_attention(name: str) -> bool:
    """Whether an operation (its overload packet's name) is a fused attention kernel."""
    return (
        "scaled_dot_product" in name or "flash_attention" in name or "efficient_attention" in name
    )


def count_replica(cfg, batch, max_real_params: float | None = None) -> Work:
    """One whole replica's optimizer step (forward, backward, with the job's activation
    checkpointing, float8 layers and precision) counted on fake tensors; a model whose shapes
    depend on the data (routed experts) is counted on real tensors when small, else estimated
    at 6 FLOPs per active parameter (`active_parameters`) and token. Float8 layers run as on the
    job's device: on a GPU torchao's float8 matmuls (`_scaled_mm`, counted apart in
    `float8_flops`) and the casts before them (other bytes); on the CPU its emulation
    (ordinary matmuls on float8-rounded operands)."""
    from framework.callbacks.throughput.callback import sizes_in
    from framework.parallel import float8
    from framework.parallel.transforms import ModelTransforms
    from framework.preflight import fakes
    from framework.preflight import simulate as sim
    from framework.preflight.counting import REAL_COUNT_PARAMS

    max_real_params = REAL_COUNT_PARAMS if max_real_params is None else max_real_params
    rows, tokens = sizes_in(batch)
    accumulate = int(cfg.trainer.get("accumulate_grad_batches", 1) or 1)
    cuda = str(cfg.trainer.get("accelerator")) != "cpu"
    mode = sim.fake_mode()
    with sim._quiet_logging():
        task = sim.build_fake_task(cfg.task, mode, cfg.trainer.precision)
        settings = float8.settings_for(cfg.trainer, cuda)
        ModelTransforms(cfg.trainer.activation_checkpointing, False, settings).apply(task)
        counter = counting_mode()
        synced = count_synced_logs(task)
        try:
            with sim.autocast(cfg.trainer.precision), counter:
                sim.whole_step(task, fakes.fake_batch(mode, batch), False)()
            how = "fake tensors"
            stepped = count_optimizer_step(task, cuda)
        except fakes.data_dependent():
            n = sum(p.numel() for p in task.parameters())
            found = [0]  # the optimizer's launches, counted on the real task
            counter, how = (None, "")
            if n <= max_real_params:
                counter, how = real_count(cfg, batch, synced, found)
            stepped = found[0]
            if counter is None:
                active = active_parameters(task)
                return Work(6.0 * active * max(tokens, rows) * accumulate, 0.0, 0,
                            tokens * accumulate, rows * accumulate,
                            "6 x active parameters x tokens (data-dependent shapes)")  # fmt: skip
    return Work(
        float(counter.flops) * accumulate,
        float(counter.bytes) * accumulate,
        counter.ops * accumulate,
        tokens * accumulate,
        rows * accumulate,
        how,
        float(counter.attention_flops) * accumulate,
        synced[0] * accumulate,
        stepped,
        counter.other_ops * accumulate,
        counter.matmuls * accumulate,
        float(counter.float8_flops) * accumulate,
    )


def count_optimizer_step(task, cuda: bool) -> int:
    """Operations a step of the task's optimizer launches over the whole replica (its
    gradients in place from the counted backward), as torch runs it on the job's device: a
    loop over the parameters on the CPU (about 9 per parameter for AdamW: 264 for the
    benchmarks' small GPT, 28 parameters, most of its 1.24 ms step here), the foreach form on
    CUDA, a few for all of them (simulate.optimizer_of); a model counted on real tensors
    steps on them. 0: not counted. Its bytes are not taken from the count: a step reads and
    writes each parameter's bytes about 20 times (37 MB for that GPT), but a small model's
    states stay in the caches, where 37 MB at the copy rate would take twice the whole step."""
    from framework.preflight import simulate as sim

    try:
        optimizer = sim.optimizer_of(task, cuda)
        optimizer.step()  # the first step also makes the state: a later one is counted
        counter = counting_mode()
        with counter:
            optimizer.step()
    except Exception as err:  # noqa: BLE001 - an optimizer fake tensors cannot step: not counted
        log.debug("The optimizer step was not counted: %s", err)
        return 0
    return counter.ops


def count_synced_logs(task) -> list[int]:
    """Counts, in the returned list's one item, the values `task` logs with `sync_dist=True`
    (`self.log`, `self.log_dict`): each is a blocking all-reduce over every process at every
    training step under a Trainer (the strategy's `reduce`). Without one the calls do nothing."""
    found = [0]
    log, log_dict = task.log, task.log_dict

    def counted_log(name, value, *args, **kwargs):
        found[0] += bool(kwargs.get("sync_dist"))
        return log(name, value, *args, **kwargs)

    def counted_log_dict(values, *args, **kwargs):
        found[0] += len(values) if kwargs.get("sync_dist") else 0
        return log_dict(values, *args, **kwargs)

    task.log, task.log_dict = counted_log, counted_log_dict
    return found


def active_parameters(task) -> float:
    """The parameters one token runs through: all of them, less the experts a token is not
    routed to. Each stacked expert weight of a framework.nn MoE layer, or of a model family's
    MoE block (a transformers model's: the modules its `ep_plan` names), counts top_k /
    num_experts of its size."""
    from framework.parallel.experts import moe_layers
    from framework.parallel.model import adapter_for

    total = float(sum(p.numel() for p in task.parameters()))
    idle, seen = 0.0, set()

    def routed(weights, k, experts) -> None:
        nonlocal idle
        for w in weights:
            if k and experts and id(w) not in seen:
                seen.add(id(w))
                idle += w.numel() * (1 - min(k, experts) / experts)

    for layer in moe_layers(task):
        router = getattr(layer, getattr(layer, "router_name", "router"), None)
        k = getattr(layer.router, "top_k", None) or getattr(router, "top_k", None)
        names = layer.experts.weight_names
        routed([getattr(layer.experts, n) for n in names], k, layer.num_experts)
    for found in adapter_for(task).routed_weights(task):
        routed(found.weights, found.top_k, found.num_experts)
    return total - idle


def real_count(cfg, batch, synced: list[int] | None = None, stepped: list[int] | None = None):
    """The count on real tensors (a small model whose step depends on its data); the values it
    logs with sync_dist in `synced` (count_synced_logs) and its optimizer's launches in `stepped`
    (count_optimizer_step), when given."""
    import torch

    from framework.instantiate import build_task
    from framework.preflight import simulate as sim

    torch.manual_seed(int(cfg.seed))
    task = build_task(cfg.task)
    counter = counting_mode()
    found = count_synced_logs(task)
    with sim._quiet_logging(), sim.autocast(cfg.trainer.precision), counter:
        sim.whole_step(task, batch, False)()
    if synced is not None:
        synced[:] = found
    if stepped is not None:
        stepped[:] = [count_optimizer_step(task, str(cfg.trainer.get("accelerator")) != "cpu")]
    return counter, "real tensors (data-dependent shapes)"
