"""What `fw plan` predicts step times for: the known GPUs and the links between them, or a
machine measured by `fw calibrate` (framework/preflight/calibrate.py) and read back from its file.

Figures are the vendors' datasheet numbers, dense (without 2:4 sparsity), per GPU:
- H100 SXM5, H100 NVL and H100 PCIe: NVIDIA H100 Tensor Core GPU datasheet (2023), "Technical
  Specifications" table; the sparse figures there are twice the dense ones given here. The NVL
  part (350-400 W) has 94 GB of HBM3 at 3.9 TB/s and an NVLink bridge between pairs.
- H200 SXM: NVIDIA H200 Tensor Core GPU datasheet (2024); the same Hopper compute as H100 SXM,
  141 GB HBM3e at 4.8 TB/s.
- A100 SXM4 80GB: NVIDIA A100 Tensor Core GPU datasheet (2021).
- B200: NVIDIA HGX B200 / DGX B200 datasheet (2024), per GPU (the 8-GPU figures divided by 8).
- L40S: NVIDIA L40S datasheet (2023); no NVLink, PCIe Gen4 x16.
Links are per GPU and per direction (the datasheets give NVLink as both directions summed):
- NVLink 3 (A100): 600 GB/s total, 300 GB/s each way (A100 datasheet).
- NVLink 4 (H100/H200 SXM): 900 GB/s total, 450 GB/s each way (H100 datasheet).
- NVLink 5 (B200): 1.8 TB/s total, 900 GB/s each way (HGX B200 datasheet).
- PCIe Gen5 x16: 128 GB/s total, 64 GB/s each way; Gen4 x16: 32 GB/s each way (PCI-SIG).
- InfiniBand NDR: 400 Gb/s per GPU (one ConnectX-7 port per GPU, as in DGX H100) = 50 GB/s;
  RoCE at 400 GbE: the same line rate.
The latencies (one collective's fixed cost) are not datasheet figures: a few microseconds for
NCCL within a node, more across; `fw calibrate` measures them for a real backend.

`host` is the host's cost per call of the work a layout adds in Python (framework/preflight/
perf.py's host term): `dtensor_op`, one operation dispatched on DTensors beyond the plain
operation's launch; `collective`, the fixed cost of one collective the communication term does
not list; `fsdp_unit`, one FSDP2 unit's hooks and copies in one step; `step`, the training
loop's own work around one optimizer step (Lightning's loop, hooks and closure: `fw calibrate`
measures 0.2-0.6 ms here; a server core several times faster, 0.1 ms assumed). For GPUs these are
assumptions, not datasheet figures: `fw calibrate` measures about 0.05 ms for an operation in a
tensor-parallel step (hooks, autograd) and 0.45 ms for an FSDP2 unit on this project's 2-core CPU
machines; a server core with a free host runs Python several times faster, so 20 us; an NCCL
call's launch is a few microseconds; an FSDP2 unit's four hooks and its copy-in and copy-out
launches, 100 us. On a GPU they count only where the host's work outlasts the
kernels' (small models, many small ops). benchmarks/plan_vs_published.py writes its layouts by
hand, without host counts: its rows do not change.

`efficiency` is the one fraction of the dense peak the device class reaches on a training step's
large matrix multiplies (cuBLAS GEMMs of transformer sizes reach about 0.7 of the dense peak on
Hopper and Ampere data-centre parts, NVIDIA's published GEMM figures; Blackwell's are not yet as
close to peak, and a PCIe or Ada card runs at a lower power limit). It is one number per device
class, never per model or layout.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from framework.errors import ConfigError

CALIBRATION_KIND = "fw-calibration"  # the marker a calibration file carries
CALIBRATED_GAP_S = 0.003  # compute before each all-reduce fw calibrate times (a layer's)
STEP_PROBE_BYTES = 2**19  # the message of each all-reduce in fw calibrate's tensor-parallel step


@dataclass(frozen=True)
class Link:
    """One interconnect, per GPU and per direction."""

    name: str
    gb_per_s: float  # bandwidth, 1e9 bytes per second
    latency_s: float  # fixed cost of one collective over it
    # measured (fw calibrate): seconds of one blocking all-reduce by its message's bytes (as
    # text), as a step meets it; none: latency + bytes over bandwidth
    allreduce_s: dict = field(default_factory=dict, hash=False)


@dataclass(frozen=True)
class Device:
    """One accelerator and the links it sits on."""

    name: str
    tflops: dict[str, float]  # dense peak TFLOP/s by dtype: bf16, fp16, tf32, fp32 (fp8)
    memory_gib: float
    hbm_gb_per_s: float  # memory bandwidth, 1e9 bytes per second
    efficiency: float  # fraction of the peak a step's large matmuls reach (see the docstring)
    intra: Link  # between the GPUs of one node
    inter: Link  # between nodes
    gpus_per_node: int = 8
    op_overhead_s: float = 4e-6  # host-side cost of launching one eager operation
    overlap: float = 1.0  # the share of data-parallel traffic that can hide behind backward
    data_wait_s: float = 0.0  # per step, when calibrated
    accelerator: str = "gpu"  # trainer.accelerator of a job on it ("cpu" for a calibrated CPU)
    measured: dict = field(default_factory=dict)  # a calibration's raw figures
    host: dict = field(default_factory=dict)  # seconds per call: dtensor_op, collective, fsdp_unit
    # fused attention's TFLOP/s by dtype as measured (fw calibrate); none: the matmuls' rate
    attention_tflops: dict = field(default_factory=dict)
    # the share of the peak matmuls reach by the FLOPs of one call, as measured on a
    # transformer's linear layers (fw calibrate); none: `efficiency` at every size
    matmul_share: dict = field(default_factory=dict)
    # by how a blocking collective is issued and the compute before it (seconds, as text), as
    # measured (fw calibrate): `c10d`, a 1 KiB all-reduce's time; `functional`, what one adds
    # to a tensor-parallel step (messages of STEP_PROBE_BYTES); none: the link's
    waits: dict = field(default_factory=dict)
    # GB/s of the operations without a FLOP formula (norms, activations, residual adds, the
    # loss) by the bytes one of them moves, as measured (fw calibrate); none: hbm_gb_per_s
    elementwise_gb_per_s: dict = field(default_factory=dict)

    def peak(self, dtype: str) -> float:
        """FLOP/s of the matmuls in `dtype` (fp32 math runs on tf32 tensor cores only when
        asked to, so fp32 is fp32)."""
        return self.tflops.get(dtype, self.tflops["fp32"]) * 1e12

    def attention_rate(self, dtype: str) -> float:
        """FLOP/s of the fused attention kernels in `dtype`: measured, else the matmuls'."""
        measured = self.attention_tflops.get(dtype) or self.attention_tflops.get("fp32")
        return measured * 1e12 if measured else self.peak(dtype) * self.efficiency

    def matmul_efficiency(self, flops_per_call: float) -> float:
        """The share of the peak a step's matmuls reach when each computes `flops_per_call`:
        measured at several sizes (`matmul_share`, interpolated, `by_size`); else `efficiency`."""
        return by_size(self.matmul_share, flops_per_call, self.efficiency)

    def waited(self, link: Link, kind: str, gap_s: float) -> Link:
        """`link` as one blocking collective issued as `kind` meets it after `gap_s` of
        compute, where waits were measured (else `link` as it is):
        - `c10d` (DDP, FSDP2, the pipeline's sends, logged values): its latency and its
          measured times moved by the wait's difference from the one after `CALIBRATED_GAP_S`
          (when they were timed);
        - `functional` (DTensor's, under tensor, expert and context parallelism): each call
          what one added to a tensor-parallel step of that compute per collective, plus the
          time a message larger than that step's (`STEP_PROBE_BYTES`) takes longer on its
          own (the fastest all-reduce by size, `measured`)."""
        if not self.waits.get(kind):
            return link
        if kind == "functional":
            added = by_size(self.waits[kind], gap_s, 0.0)
            fastest = self.measured.get("allreduce_fastest_s_by_bytes") or {}
            base = by_size(fastest, STEP_PROBE_BYTES, 0.0)
            times = {size: added + max(0.0, s - base) for size, s in fastest.items()}
            return replace(link, latency_s=added, allreduce_s=times or {"1": added})
        shift = by_size(self.waits[kind], gap_s, 0.0) - by_size(
            self.waits[kind], CALIBRATED_GAP_S, 0.0
        )
        times = {size: max(0.0, s + shift) for size, s in link.allreduce_s.items()}
        return replace(link, latency_s=max(0.0, link.latency_s + shift), allreduce_s=times)

    def elementwise_rate(self, bytes_per_op: float) -> float:
        """Bytes per second that operations without a FLOP formula move when each moves
        `bytes_per_op`: measured at several sizes (interpolated, `by_size`; on a CPU the rate
        follows the caches a tensor fits in); else the memory bandwidth."""
        return by_size(self.elementwise_gb_per_s, bytes_per_op, self.hbm_gb_per_s) * 1e9


def by_size(measured: dict, size: float, default: float) -> float:
    """The figure `measured` ({size: figure}, sizes as text in a calibration file) gives at
    `size`: interpolated on a log scale of the size between the sizes measured, held at the
    first and last; `default` when nothing was measured or the size is unknown (0)."""
    points = sorted((float(at), figure) for at, figure in measured.items())
    if not points or size <= 0:
        return default
    if size <= points[0][0]:
        return points[0][1]
    for (small, low), (large, high) in itertools.pairwise(points):
        if size <= large:
            return low + math.log(size / small) / math.log(large / small) * (high - low)
    return points[-1][1]


NVLINK3 = Link("NVLink 3", 300.0, 5e-6)
NVLINK4 = Link("NVLink 4", 450.0, 5e-6)
NVLINK5 = Link("NVLink 5", 900.0, 5e-6)
PCIE4 = Link("PCIe Gen4 x16", 32.0, 10e-6)
PCIE5 = Link("PCIe Gen5 x16", 64.0, 10e-6)
IB_NDR = Link("InfiniBand NDR 400 Gb/s", 50.0, 15e-6)
ROCE_400 = Link("RoCE 400 GbE", 50.0, 20e-6)
GPU_HOST = {"dtensor_op": 20e-6, "collective": 5e-6, "fsdp_unit": 100e-6, "step": 100e-6}  # assumed

DEVICES: dict[str, Device] = {
    "H100 SXM": Device(
        "H100 SXM",
        {"fp8": 1979.0, "bf16": 989.0, "fp16": 989.0, "tf32": 494.0, "fp32": 67.0},
        80.0,
        3350.0,
        0.7,
        NVLINK4,
        IB_NDR,
        host=GPU_HOST,
    ),
    "H100 PCIe": Device(
        "H100 PCIe",
        {"fp8": 1513.0, "bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.0},
        80.0,
        2000.0,
        0.6,
        PCIE5,
        ROCE_400,
        host=GPU_HOST,
    ),
    "H100 NVL": Device(
        "H100 NVL",
        {"fp8": 1670.5, "bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0},
        94.0,
        3900.0,
        0.6,
        Link("NVLink bridge (pairs)", 300.0, 5e-6),
        ROCE_400,
        host=GPU_HOST,
    ),
    "H200": Device(
        "H200",
        {"fp8": 1979.0, "bf16": 989.0, "fp16": 989.0, "tf32": 494.0, "fp32": 67.0},
        141.0,
        4800.0,
        0.7,
        NVLINK4,
        IB_NDR,
        host=GPU_HOST,
    ),
    "A100 SXM 80GB": Device(
        "A100 SXM 80GB",
        {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
        80.0,
        2039.0,
        0.7,
        NVLINK3,
        Link("InfiniBand HDR 200 Gb/s", 25.0, 15e-6),
        host=GPU_HOST,
    ),
    "B200": Device(
        "B200",
        {"fp8": 4500.0, "bf16": 2250.0, "fp16": 2250.0, "tf32": 1100.0, "fp32": 75.0},
        180.0,
        8000.0,
        0.6,
        NVLINK5,
        IB_NDR,
        host=GPU_HOST,
    ),
    "L40S": Device(
        "L40S",
        {"fp8": 733.0, "bf16": 362.0, "fp16": 362.0, "tf32": 183.0, "fp32": 91.6},
        48.0,
        864.0,
        0.6,
        PCIE4,
        ROCE_400,
        host=GPU_HOST,
    ),
}
ALIASES = {"H100": "H100 SXM", "A100": "A100 SXM 80GB", "H200 SXM": "H200"}


def known_device(name: str) -> Device:
    """The device called `name` (case and spaces aside; "H100" is the SXM part); ConfigError
    listing the known ones otherwise."""
    wanted = "".join(str(name).lower().split())
    for key in [*DEVICES, *ALIASES]:
        if "".join(key.lower().split()) == wanted:
            return DEVICES[ALIASES.get(key, key)]
    raise ConfigError(
        "--gpu",
        name,
        "is not a known GPU",
        [*DEVICES, *ALIASES],
        hint="Or measure this machine with `fw calibrate --out FILE` and pass --hardware FILE.",
    )


def write_calibration(device: Device, path: Path) -> None:
    """`device` as a calibration file (JSON, which YAML readers read too)."""
    record = {"kind": CALIBRATION_KIND, **asdict(device)}
    path.write_text(json.dumps(record, indent=2) + "\n")


def read_calibration(path: str) -> Device:
    """The device a `fw calibrate` file describes; ConfigError for anything else."""
    source = Path(path)
    try:
        record = json.loads(source.read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(
            "--hardware",
            path,
            f"is not a calibration file ({type(err).__name__})",
            hint="Write one with `fw calibrate --out FILE`.",
        ) from None
    if not isinstance(record, dict) or record.get("kind") != CALIBRATION_KIND:
        raise ConfigError(
            "--hardware",
            path,
            f'is not a calibration file (no "kind": "{CALIBRATION_KIND}")',
            hint="Write one with `fw calibrate --out FILE`.",
        )
    try:
        record.pop("kind")
        record["intra"], record["inter"] = Link(**record["intra"]), Link(**record["inter"])
        return Device(**record)
    except (TypeError, KeyError) as err:
        raise ConfigError("--hardware", path, f"is a damaged calibration file: {err}") from None
