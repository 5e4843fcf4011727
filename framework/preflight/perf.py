"""The step time `fw plan` predicts for one layout on one device (framework/preflight/hardware.py).

step = compute + exposed communication + pipeline bubble + optimizer step + data wait, where

- compute: the rank's FLOPs over (the matmul peak in the step's dtype x the device class's
  efficiency), those of the fused attention kernels over the attention rate the calibration
  measured (a device without one: the matmuls' rate), plus the bytes that operations without
  a FLOP formula (norms, activations, residual adds, casts) read and write, at the rate such
  operations of that size reach (`Device.elementwise_rate`: measured by fw calibrate; a known
  GPU, its memory bandwidth); on a device that launches
  work ahead of the host (a GPU) the host's launch cost per operation only matters when it is
  the longer of the two, on the CPU it adds. The FLOPs and bytes are counted
  (framework/preflight/replica.py), once per plan,
  on one whole replica's step on the per-rank batch with fake tensors, with the counter
  `callbacks.throughput` uses (`framework.perf.flop_counter`'s formulas); a rank computes 1/(tp
  x pp) of the FLOPs (tensor parallel splits every matmul, a pipeline the layers) and of the
  other bytes 1/pp when the layout says it has no sequence parallel (norms, residual adds,
  embeddings and the loss then run whole on every tensor-parallel rank: counted on real
  tensors, a tp=2 rank of the benchmarks' gpt touches 0.85 of a replica's bytes, gpt_tiny's
  0.94), else 1/(tp x pp) as before (under sequence parallel gpt_tiny's rank counts 1.02, the
  redistributions' copies included: not settled at scale). Under `trainer.float8` the float8
  layers' matmuls (torchao's `_scaled_mm`, counted apart) run at the device's stated float8
  peak (`fp8` in its table: a prediction from the datasheet, at the same share of the peak as
  the other matmuls, not a measurement), and the casts before them are other bytes; a
  device with no float8 rate (an A100, a calibration file) is refused for a float8 job.
- communication: the bytes per collective the plan lists (traffic.traffic: the plugin's
  data-parallel bytes, 4bsh per layer for tensor parallel, 2bsh per stage boundary, the
  experts' all-to-all, context parallel's K/V), each over the link its group crosses
  (tensor parallel ranks are adjacent and stay within a node; a data-parallel group crosses
  nodes once a pipeline position spans more than one node), plus a latency per collective. The
  share of the data-parallel traffic a strategy sends during backward (its plugin's
  `data_overlap`: DDP's bucketed all-reduce and FSDP's prefetched gathers all of it; ZeRO-1/2
  the reduce-scatter, half, not the all-gather after the optimizer step; DeepSpeed without
  `overlap_comm`, as on the CPU, and DiLoCo's round-end all-reduce none) hides behind compute
  except its last bucket, the rest blocks; tensor parallel's all-reduces and the experts'
  all-to-all block.
- bubble: the schedule's idle share, compute x (p - 1) / (v x m) for p stages, m microbatches
  and v stages per rank (gpipe and 1f1b: v = 1).
- optimizer step: memory-bound, the rank's parameters, gradients and optimizer state read and
  the parameters and state written again, over the memory bandwidth (Muon's state is one
  momentum per hidden matrix, AdamW's two moments for the rest, as fw check counts it); plus
  the matmuls the step runs on the simulated rank (Muon's Newton-Schulz, its own share of the
  matrices: framework/preflight/optimizer_work.py) at the matmul rate of their dtype; plus the
  launches of the operations the task's optimizer runs (counted on fake tensors,
  `count_optimizer_step`: on the CPU torch's AdamW loops over the parameters, about 9
  operations each). Muon's exchange of whole matrices under sharded layouts is communication
  (`optimizer` traffic, blocking: it runs after backward).
- the values the task logs with `sync_dist` (counted in its training_step): a blocking
  all-reduce of a scalar each, over every process, at every step (communication term).
- data wait: 0 unless the calibration measured one.
- host: the Python-level work of the layout's rank that the counted replica does not have,
  counted on the simulated rank of `fw check` (framework/preflight/simulate.py: the strategy's
  own parallelize and one step on the fake backend) with `counting.host_counting`: operations dispatched
  on DTensors (tensor parallel's sharded modules, FSDP2's sharded parameters in the optimizer
  step, the experts' mesh), and collectives issued beyond those the communication term already
  charges (FSDP2's per-unit all-gathers and reduce-scatters, tensor parallel's all-reduces
  beyond 4 per layer), and FSDP2 units (each one's hooks and copies per step). Each count
  times its per-unit
  cost (`Device.host`: measured by `fw calibrate`, small defaults for GPUs); forward and
  backward counts times the microbatches, the optimizer step's once, and a pipeline's FSDP2
  reduce-scatters once (torch's schedule reduces the gradients after the last microbatch:
  at pp 2 x fsdp 2 with 4 microbatches a step issues 10 all-gathers and 2 reduce-scatters,
  where 4 microbatches of the simulated one are 16 and 8); the slowest simulated
  rank's sum; plus the training loop's own work once per optimizer step (`step`: Lightning's
  loop around a step, measured by `fw calibrate` as a Trainer's step of a small model less
  the same step written plainly). On the CPU the host is the device: the term adds. On a GPU
  the host runs ahead
  of the kernels, so only what the host's work (launches and this) takes beyond the device's
  busy time is added.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from framework.preflight.hardware import Device, Link, by_size
from framework.preflight.replica import Work

BUCKET_BYTES = 25 * 2**20  # DDP's default bucket; FSDP's units are of that order too


@dataclass
class Prediction:
    """One layout's predicted step on one device, in seconds, and what follows from it."""

    compute_s: float
    comm_s: float
    bubble_s: float
    optimizer_s: float
    data_s: float
    rank_flops: float
    tokens_per_step: float
    peak_flops: float
    host_s: float = 0.0

    @property
    def step_s(self) -> float:
        return sum(self.terms.values())

    @property
    def terms(self) -> dict[str, float]:
        """The step's terms in seconds, by name (what `fw plan --json` lists as terms_s)."""
        return {
            "compute": self.compute_s,
            "communication": self.comm_s,
            "bubble": self.bubble_s,
            "optimizer": self.optimizer_s,
            "data": self.data_s,
            "host": self.host_s,
        }

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s

    @property
    def mfu(self) -> float:
        return self.rank_flops / self.step_s / self.peak_flops

    @property
    def dominant(self) -> str:
        terms = self.terms
        return max(terms, key=terms.get)


def matmul_dtype(precision: str) -> str:
    """The dtype the step's matmuls run in under `trainer.precision`."""
    text = str(precision)
    if text.startswith("bf16"):
        return "bf16"
    if text.startswith("16"):
        return "fp16"
    return "fp32"


def collective_s(nbytes: float, count: int, ranks: int, link: Link) -> float:
    """Time of `count` collectives moving `nbytes` in all: ring volume ((N-1)/N applied) over
    the bandwidth and a latency per call and log2 N rounds; over a measured link, each call at
    the time measured for its message's size (`Link.allreduce_s`, interpolated)."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    if link.allreduce_s:
        return count * by_size(link.allreduce_s, nbytes / max(1, count), link.latency_s)
    rounds = max(1, math.ceil(math.log2(ranks)))
    return nbytes * (ranks - 1) / ranks / (link.gb_per_s * 1e9) + count * rounds * link.latency_s


def predict(work: Work, layout: dict[str, Any], device: Device) -> Prediction:
    """The step of one rank under `layout` (traffic.layout_facts: degrees, groups, bytes, model
    states, schedule) on `device`."""
    tp, pp = layout["tp"], layout["pp"]
    share = tp * pp
    dtype = matmul_dtype(layout["precision"])
    peak = device.peak(dtype)
    flops = work.flops / share
    float8 = work.float8_flops / share  # the float8 layers' matmuls, split as the others
    if float8 and "fp8" not in device.tflops:
        raise no_float8(device)
    # without sequence parallel, norms, residual adds, embeddings and the loss run whole on
    # every tensor-parallel rank (a layout that does not say keeps the old split)
    spread = share if layout.get("sequence_parallel", True) else pp
    attention = work.attention_flops / share  # the heads split as the matmuls do
    other = work.other_bytes / spread
    # the size of one such operation: split as the bytes are, less the pipeline's share
    each = other / (work.other_ops / pp) if work.other_ops else 0.0
    # the size of one matmul: tensor parallel splits each, a pipeline takes its share of them
    call = (work.flops - work.attention_flops) / tp / work.matmuls if work.matmuls else 0.0
    efficiency = device.matmul_efficiency(call)
    busy = (
        (flops - attention - float8) / (peak * efficiency)
        + (float8 / (device.peak("fp8") * efficiency) if float8 else 0.0)
        + attention / device.attention_rate(dtype)
        + other / device.elementwise_rate(each)
    )
    launch = work.ops / pp * layout["microbatches"] * device.op_overhead_s  # per microbatch
    compute = max(busy, launch) if device.accelerator != "cpu" else busy + launch
    bubble = 0.0
    if pp > 1:
        bubble = compute * (pp - 1) / (layout["virtual_stages"] * layout["microbatches"])
    synced = work.synced_logs if layout.get("world_size", 1) > 1 else 0
    # the compute between two of the rank's blocking collectives: the longer, the longer each
    # waits for its peers (Device.waited: measured by fw calibrate; a known GPU: its links' latency)
    syncs = sum(charged_collectives(layout).values()) + sum(extra_collectives(layout).values())
    gap = compute / max(1, syncs + synced)
    comm = exposed_comm(layout, device, compute, synced, gap)
    host = host_work_s(layout, device, gap)
    if device.accelerator != "cpu":  # the part of the host's work the kernels do not hide
        host = max(busy, launch + host) - compute
    states = layout["state_bytes"]
    optimizer = (2 * states["params"] + states["grads"] + 2 * states["optimizer"]) / (
        device.hbm_gb_per_s * 1e9
    )
    optimizer += optimizer_matmuls_s(layout, device)
    # the launches of its operations: a rank steps each of its stage's tensors (or shards)
    ops = work.optimizer_ops / pp * device.op_overhead_s
    optimizer = optimizer + ops if device.accelerator == "cpu" else max(optimizer, ops)
    tokens = (work.tokens or work.rows) * layout["data_ranks"]
    return Prediction(
        compute, comm, bubble, optimizer, device.data_wait_s, flops, tokens, peak, host
    )


def optimizer_matmuls_s(layout: dict[str, Any], device: Device) -> float:
    """Seconds of the matmuls the rank's optimizer step runs (`optimizer_flops` by dtype, as
    counted on the simulated rank: Muon's Newton-Schulz, bf16 unless `ns_dtype` says float32),
    each dtype at its peak times the share matmuls of their size reach."""
    flops = layout.get("optimizer_flops") or {}
    calls = layout.get("optimizer_matmuls") or 0
    if not calls:
        return 0.0
    efficiency = device.matmul_efficiency(sum(flops.values()) / calls)
    return sum(n / (device.peak(dtype) * efficiency) for dtype, n in flops.items())


def no_float8(device: Device):
    """The ConfigError for a float8 job planned on a device without a float8 matmul rate."""
    from framework.errors import ConfigError

    key, where = (
        ("--hardware", "its calibration") if device.measured else ("--gpu", "its datasheet")
    )
    return ConfigError(
        key,
        device.name,
        f"has no float8 matmul rate in {where}, and the job sets trainer.float8: float8 "
        "training needs a GPU of compute capability 8.9 or newer (Ada Lovelace, Hopper, "
        "Blackwell), and fw calibrate does not measure float8",
        hint="Plan with --gpu H100, H200, B200 or L40S, or plan this job in bf16 "
        "(trainer.float8=none).",
    )


def charged_collectives(layout: dict[str, Any]) -> dict[str, int]:
    """Collectives (and sends) the communication term already charges a latency for, by how
    they are issued: `c10d` (data-parallel buckets, a pipeline's receives) and `functional`
    (DTensor's, under tensor, expert and context parallelism)."""
    sizes, traffic = layout["group_sizes"], layout["traffic"]
    c10d = data_calls(layout) if sizes["data"] > 1 else 0
    c10d += layout["pipeline_receives"] if traffic["pipeline"] else 0
    functional = layout["tensor_collectives"] if sizes["tensor"] > 1 else 0
    functional += layout["expert_collectives"] if sizes["experts"] > 1 else 0
    functional += layout.get("context_collectives", 0) if traffic.get("context") else 0
    return {"c10d": c10d, "functional": functional}


def data_calls(layout: dict[str, Any]) -> int:
    """Blocking collectives a step issues for its data-parallel traffic: as many as its
    strategy states (`data_collectives`), else one per 25 MiB bucket."""
    stated = layout.get("data_collectives")
    return int(stated) if stated else math.ceil(layout["traffic"]["data"] / BUCKET_BYTES)


def issued_collectives(counts: dict[str, int], micro: int) -> dict[str, int]:
    """The collectives one simulated rank's `counts` (a `host_counts` record) issue in a step,
    by how they are issued: a microbatch's in each, its reduce-scatters once (a pipeline's FSDP2
    stage reduces its gradients after the last microbatch; no other layout has microbatches)
    and the optimizer step's once."""
    once = counts.get("reductions", 0)
    issued = (counts["collectives"] - once) * micro + once + counts["optimizer_collectives"]
    functional = counts.get("functional", 0) * micro + counts.get("optimizer_functional", 0)
    return {"c10d": issued - functional, "functional": functional}


def extra_collectives(layout: dict[str, Any]) -> dict[str, int]:
    """Collectives the slowest simulated rank issues beyond those charged, by how they are
    issued (the host term charges them)."""
    charged = charged_collectives(layout)
    extra = {"c10d": 0, "functional": 0}
    for counts in layout.get("host_counts", []):
        issued = issued_collectives(counts, layout["microbatches"])
        for kind in extra:
            extra[kind] = max(extra[kind], issued[kind] - charged[kind])
    return extra


def host_work_s(layout: dict[str, Any], device: Device, gap_s: float = 0.0) -> float:
    """Seconds of the host's per-call work on the slowest simulated rank (`host_counts`, one
    record per rank: forward and backward of one microbatch, `optimizer_*` for the step, and
    `fsdp_units`, whose hooks run each microbatch; the `reductions` among its collectives run
    once per step): DTensor dispatches, the collectives beyond those already charged (each
    at the wait of its kind after `gap_s` of compute where the device measured one, else at
    `collective`) and FSDP2 units, each at its cost (`Device.host`); and the training loop's
    own work per optimizer step (`step`)."""
    micro = layout["microbatches"]
    cost = {"dtensor_op": 0.0, "collective": 0.0, "fsdp_unit": 0.0, "step": 0.0, **device.host}
    charged = charged_collectives(layout)
    fixed = Link("host", 0.0, cost["collective"])
    wait = {kind: device.waited(fixed, kind, gap_s).latency_s for kind in charged}
    slowest = 0.0
    for counts in layout.get("host_counts", []):
        dtensors = counts["dtensor_ops"] * micro + counts["optimizer_dtensor_ops"]
        issued = issued_collectives(counts, micro)
        seconds = (
            dtensors * cost["dtensor_op"]
            + sum(max(0, issued[k] - charged[k]) * wait[k] for k in wait)
            + counts.get("fsdp_units", 0) * micro * cost["fsdp_unit"]
        )
        slowest = max(slowest, seconds)
    return slowest + cost["step"]  # the training loop's own work, once per optimizer step


FUNCTIONAL_GROUPS = ("tensor", "experts", "context")  # their collectives are DTensor's


def link_of(group: str, layout: dict[str, Any], device: Device, gap_s: float = 0.0) -> Link:
    """The link the group's traffic crosses (within a node unless the group spans nodes), as
    one of its blocking collectives meets it after `gap_s` of compute (`Device.waited`)."""
    link = device.inter if layout["spans_nodes"][group] else device.intra
    return device.waited(link, "functional" if group in FUNCTIONAL_GROUPS else "c10d", gap_s)


def exposed_comm(
    layout: dict[str, Any], device: Device, compute_s: float, synced: int = 0, gap_s: float = 0.0
) -> float:
    """Seconds of the step's communication that compute does not hide (the module's docstring),
    each blocking collective at its wait after `gap_s` of compute."""
    traffic, sizes = layout["traffic"], layout["group_sizes"]
    data = traffic["data"]
    buckets = max(1, data_calls(layout))
    data_s = collective_s(data, buckets, sizes["data"], link_of("data", layout, device, gap_s))
    # the share the strategy sends during backward (`data_overlap`): all but its last bucket
    share = layout.get("data_overlap", 1.0)
    hidden = min(max(0.0, share * data_s - data_s / buckets), device.overlap * compute_s)
    blocking = collective_s(
        traffic["tensor"], layout["tensor_collectives"], sizes["tensor"],
        link_of("tensor", layout, device, gap_s),
    ) + collective_s(
        traffic["experts"], layout["expert_collectives"], sizes["experts"],
        link_of("experts", layout, device, gap_s),
    )  # fmt: skip
    # point to point: the whole volume crosses the link, one latency per blocking receive
    p2p = traffic["pipeline"]
    link = link_of("pipeline", layout, device, gap_s)
    pipe = 0.0
    if p2p:
        pipe = p2p / (link.gb_per_s * 1e9) + layout["pipeline_receives"] * link.latency_s
    # Muon's exchange of whole matrices after backward (its all-to-alls' latency is in the
    # host term, which counts the collectives the simulated optimizer step issues): blocking,
    # over the data-parallel group's link where it shards, else the tensor group's
    exchange = traffic.get("optimizer", 0.0)
    if exchange:
        group = "data" if sizes["data"] > 1 else "tensor"
        blocking += exchange / (link_of(group, layout, device, gap_s).gb_per_s * 1e9)
    # context parallel's K/V: the bytes that leave the rank (traffic.context_bytes), blocking
    kv = traffic.get("context", 0.0)
    if kv:
        link = link_of("context", layout, device, gap_s)
        blocking += kv / (link.gb_per_s * 1e9) + layout["context_collectives"] * link.latency_s
    # the values the task logs with sync_dist: a blocking all-reduce of a scalar each, over all
    if synced and layout.get("world_size", 1) > 1:
        link = device.inter if layout.get("world_spans_nodes") else device.intra
        link = device.waited(link, "c10d", gap_s)
        blocking += collective_s(4.0 * synced, synced, layout["world_size"], link)
    return max(0.0, data_s - hidden) + blocking + pipe
