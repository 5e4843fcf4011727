"""What a device can do and what a model asks of it: peak FLOP/s and memory of known GPUs, the
FLOPs of a transformer step, and how a memory size is written on the command line.

Used by the throughput callback (MFU), `fw check` / `fw plan` (memory per rank) and the GPU
benchmark. Peak figures are the vendors' dense (no sparsity) bf16 tensor-core numbers for the
SXM/OAM parts; a PCIe card of the same name is slower, so set `trainer.peak_tflops` for one.
"""

from __future__ import annotations

import re

from framework.errors import ConfigError

# name: (dense bf16 TFLOP/s, memory in GB as sold). A name matches torch's device name when its
# words appear there in a row, whole ("L4" is not in "NVIDIA L40"); the longest name that
# matches wins ("H100 NVL" over "H100"). V100 has no bf16 tensor cores, so no bf16 peak (None):
# its 125 TFLOP/s are fp16; set trainer.peak_tflops=125 for MFU under 16-mixed.
GPUS: dict[str, tuple[float | None, float]] = {
    "H200": (989.0, 141.0),
    "H100 PCIe": (756.0, 80.0),
    "H100 NVL": (835.0, 94.0),
    "H100": (989.0, 80.0),
    "H800": (989.0, 80.0),
    "GH200": (989.0, 96.0),
    "B200": (2250.0, 180.0),
    "A100-SXM4-40GB": (312.0, 40.0),
    "A100": (312.0, 80.0),
    "A800": (312.0, 80.0),
    "L40S": (362.0, 48.0),
    "L40": (181.0, 48.0),
    "L4": (121.0, 24.0),
    "A10G": (70.0, 24.0),
    "A10": (125.0, 24.0),
    "V100": (None, 32.0),
    "RTX 4090": (165.0, 24.0),
    "RTX 3090": (71.0, 24.0),
}

_UNITS = {"": 1, "b": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def _words(name: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", name.lower())


def known_gpu(name: str) -> str | None:
    """The key of GPUS that `name` (e.g. "NVIDIA H100 80GB HBM3") refers to, or None."""
    words = _words(name)
    for key in sorted(GPUS, key=lambda k: len(_words(k)), reverse=True):
        want = _words(key)
        if any(words[i : i + len(want)] == want for i in range(len(words) - len(want) + 1)):
            return key
    return None


def peak_tflops(name: str) -> float | None:
    """Dense bf16 peak of the GPU called `name`, or None for an unknown device, the CPU, and a
    GPU without bf16 tensor cores (V100)."""
    key = known_gpu(name)
    return GPUS[key][0] if key else None


def parse_memory(key: str, text: str) -> int:
    """Bytes from '80GB', '80 GiB', '512MB', '1e9' or a known GPU's name ('H100');
    ConfigError naming `key` otherwise. GB and GiB are both read as 2**30 (as torch reports)."""
    found = known_gpu(str(text))
    if found and not re.fullmatch(r"[\d.eE+]+\s*\w*", str(text).strip()):
        return int(GPUS[found][1] * 2**30)
    match = re.fullmatch(r"([\d.]+(?:[eE][+-]?\d+)?)\s*([kmgtKMGT]?)(i?[bB])?", str(text).strip())
    if not match:
        raise ConfigError(
            key,
            text,
            "is not a memory size or a known GPU",
            ["80GB", "40GiB", "512MB", *sorted(GPUS)[:6]],
        )
    number, unit = float(match.group(1)), match.group(2).lower()
    if number <= 0:
        raise ConfigError(key, text, "must be above zero")
    return int(number * _UNITS[unit])


def transformer_flops_per_token(
    matmul_params: int, n_layer: int, seq_len: int, d_model: int
) -> float:
    """Training FLOPs per token of a decoder-only transformer (forward + backward, no
    recomputation): 6 per parameter that multiplies an activation (every weight matrix,
    including the output head; not position embeddings or norms' scales), plus 12 x layers x
    sequence x width for the attention scores and their weighted sum (the PaLM paper's
    appendix B formula; causal masking is not subtracted)."""
    return 6.0 * matmul_params + 12.0 * n_layer * seq_len * d_model


def gib(n_bytes: float) -> float:
    return n_bytes / 2**30


def count_cpu_attention() -> None:
    """Teach torch's FlopCounterMode the CPU attention kernels (it knows only the CUDA ones), with
    the same counts it uses for those: forward, the scores and their weighted sum (2 matmuls);
    backward, the scores again and four gradient matmuls."""
    import torch
    from torch.utils import flop_counter

    aten = torch.ops.aten
    forward = aten._scaled_dot_product_flash_attention_for_cpu
    backward = aten._scaled_dot_product_flash_attention_for_cpu_backward
    if forward in flop_counter.flop_registry:
        return

    def pair(query_shape, key_shape, value_shape) -> int:
        """FLOPs of q @ k^T and of scores @ v (2 per multiply-add)."""
        b, heads, s_q, d = query_shape
        s_k, d_v = key_shape[2], value_shape[3]
        return 2 * b * heads * s_q * s_k * (d + d_v)

    @flop_counter.register_flop_formula(forward)
    def _forward(query, key, value, *args, out_shape=None, **kwargs) -> int:
        return pair(query, key, value)

    @flop_counter.register_flop_formula(backward)
    def _backward(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
        return pair(query, key, value) * 5 // 2  # five matmuls of the size of one


def count_grouped_mm() -> None:
    """Teach torch's FlopCounterMode the grouped GEMM that runs the experts of a
    mixture-of-experts layer (framework/nn/moe.py), which it does not count: 2 FLOPs per
    multiply-add over every group. Its four forms (torch's `_grouped_mm`): a [M, K] x b [G, K,
    N], rows split by `offs` (the experts' forward, the input's gradient); a [G, M, K] x b [K,
    N], columns split; a [M, K] x b [K, N], the contraction split (the weights' gradient, [G,
    M, N] out); a [G, M, K] x b [G, K, N], batched. The backward is made of these, so it is
    counted through them."""
    import torch
    from torch.utils import flop_counter

    op = torch.ops.aten._grouped_mm
    if op in flop_counter.flop_registry:
        return

    @flop_counter.register_flop_formula(op)
    def _grouped(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
        if len(a_shape) == 3 and len(b_shape) == 3:
            groups, m, k = a_shape
            return 2 * groups * m * k * b_shape[2]
        m, k = a_shape[-2:]
        return 2 * m * k * b_shape[-1]


def register_flop_formulas() -> None:
    """The kernels torch's FlopCounterMode does not count that this project runs."""
    count_cpu_attention()
    count_grouped_mm()


def flop_counter():
    """A dispatch mode counting the FLOPs this process computes, with the formulas of torch's
    FlopCounterMode (its registry) but without its module tracking, whose backward hooks break
    the pipeline schedules' `autograd.grad` calls. An operation on DTensors is seen with the
    tensors' global shapes, so its count is divided by the size of every mesh dimension over
    which one of its inputs is split (each rank computes that share). `get_total_flops()`."""
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import flop_registry

    register_flop_formulas()

    def split_over(args) -> int:
        tensors = [a for a in args if isinstance(a, DTensor)]
        if not tensors:
            return 1
        mesh = tensors[0].device_mesh
        divisor = 1
        for dim in range(mesh.ndim):
            if any(t.placements[dim].is_shard() for t in tensors if t.device_mesh == mesh):
                divisor *= mesh.size(dim)
        return divisor

    class LocalFlops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.total = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            formula = flop_registry.get(func._overloadpacket)
            if formula is not None:
                self.total += formula(*args, **kwargs, out_val=out) // split_over(args)
            return out

        def get_total_flops(self) -> int:
            return self.total

    return LocalFlops()
