"""Context parallel's per-block kernels (framework/parallel/context/kernels.py), checked without a
GPU: which kernel a block takes for each device, dtype and head size (fake CUDA tensors, which
carry only metadata); on `meta` tensors the CUDA ops actually called, forward and backward, with
the key/value heads each receives, the log-sum-exp's shape and no (s_q, s_k) tensor anywhere in
a ring step; and the block functions' numbers against attention over the whole block, the CUDA
ops stood in for by CPU emulations of their calling conventions (`EmulatedCudaOps`: fewer
key/value heads refused by the efficient kernel, its log-sum-exp padded to 32 positions with
garbage, its output in (b, s, h, d) layout). The ring and allgather modes with grouped-query
K/V on each kernel, between processes: tests/unit/test_context_attention.py."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from framework.parallel.context import kernels
from framework.parallel.context.attention import split_attention

aten = torch.ops.aten


@pytest.mark.parametrize(
    ("dtype", "head_dim", "want"),
    [
        (torch.bfloat16, 128, "flash"),
        (torch.float16, 64, "flash"),
        (torch.float32, 128, "efficient"),  # flash has no fp32
        (torch.bfloat16, 320, "efficient"),  # flash stops at 256
        (torch.float32, 6, "math"),  # no fused kernel takes this head size
        (torch.float64, 64, "math"),  # neither fused kernel takes fp64
    ],
)
def test_a_cuda_block_takes_the_memory_efficient_kernel_its_dtype_allows(dtype, head_dim, want):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():  # CUDA tensors exist here as metadata only
        q = torch.empty(1, 8, 64, head_dim, device="cuda", dtype=dtype)
        assert q.device.type == "cuda"
        assert kernels.kernel_for(q) == want
    meta = torch.empty(1, 8, 64, head_dim, device="meta", dtype=dtype)
    assert kernels.kernel_for(meta) == want, "fw check's meta device is the GPU"


def test_a_cpu_block_takes_the_fused_cpu_kernel():
    assert kernels.kernel_for(torch.empty(1, 8, 4, 8)) == "cpu"
    assert kernels.kernel_for(torch.empty(1, 8, 4, 8, dtype=torch.float64)) == "cpu"


class Ops(TorchDispatchMode):
    """Every aten op called, with the head count of its key argument for attention ops, and
    the shapes of every tensor any op returned."""

    def __init__(self):
        super().__init__()
        self.attention: list[tuple[str, int]] = []
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if "scaled_dot_product" in name:
            self.attention.append((name, args[2].shape[1]))
        for t in torch.utils._pytree.tree_leaves(out):
            if torch.is_tensor(t):
                self.shapes.append(tuple(t.shape))
        return out


@pytest.mark.parametrize(
    ("dtype", "op", "kv_heads"),
    [
        (torch.bfloat16, "_scaled_dot_product_flash_attention", 2),  # takes fewer K/V heads
        (torch.float32, "_scaled_dot_product_efficient_attention", 8),  # repeated for it
    ],
)
def test_a_cuda_ring_step_calls_the_fused_ops_and_keeps_no_score_matrix(dtype, op, kv_heads):
    """One rank's ring attention and its backward on `meta` tensors (the CUDA ops' meta
    functions run): the kernel's forward and backward op, the K/V head count each received,
    gradients of K/V with their own head count, and no tensor of (positions, positions)."""
    b, h, hk, s, d = 2, 8, 2, 50, 64  # 50 positions: the efficient kernel pads them to 64
    q = torch.empty(b, h, s, d, device="meta", dtype=dtype, requires_grad=True)
    k, v = (torch.empty(b, hk, s, d, device="meta", dtype=dtype, requires_grad=True) for _ in "kv")
    with Ops() as ops:
        out = split_attention(q, k, v, True, "ring", None, 1, 0)
        out.backward(torch.empty_like(out))
    assert ops.attention == [(op, kv_heads), (f"{op}_backward", kv_heads)]
    assert out.shape == q.shape and out.dtype == dtype
    assert k.grad.shape == v.grad.shape == k.shape and q.grad.shape == q.shape
    assert not [shape for shape in ops.shapes if shape[-2:] == (s, s)], "a score matrix was made"


def test_the_plain_operations_kernel_is_the_only_one_that_makes_scores():
    """The guard of the test above: the math kernel (fp64 on CUDA) does make (s, s) scores."""
    s = 50
    q = torch.empty(2, 8, s, 8, device="meta", dtype=torch.float64, requires_grad=True)
    with Ops() as ops:
        split_attention(q, q, q, True, "ring", None, 1, 0).sum().backward()
    assert any(shape[-2:] == (s, s) for shape in ops.shapes)


# ---- CPU emulations of the CUDA ops' calling conventions


def _efficient(q, k, v, bias, compute_lse, dropout_p, causal, *, scale=None):
    assert k.shape[1] == q.shape[1], "the efficient kernel's backward needs equal head counts"
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, dropout_p, causal, scale=scale
    )
    pad = -q.shape[2] % kernels.LSE_ROWS
    lse = torch.cat([lse, lse.new_full((*lse.shape[:2], pad), 1e30)], -1)  # garbage padding
    out = out.transpose(1, 2).contiguous().transpose(1, 2)  # its (b, s, h, d) memory layout
    return out, lse, torch.empty((), dtype=torch.long), torch.empty((), dtype=torch.long)


def _efficient_backward(
    dout, q, k, v, bias, out, lse, seed, offset, p, mask, causal, *, scale=None
):
    assert k.shape[1] == q.shape[1]
    assert lse.shape[-1] == -(-q.shape[2] // kernels.LSE_ROWS) * kernels.LSE_ROWS, lse.shape
    lse = lse[..., : q.shape[2]].contiguous()
    grads = aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, p, causal, scale=scale
    )
    return (*grads, None)


def _flash(q, k, v, dropout_p, causal, debug, *, scale=None):
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, dropout_p, causal, scale=scale
    )
    seed, offset = torch.empty(2, dtype=torch.uint64), torch.empty((), dtype=torch.uint64)
    return out, lse, None, None, q.shape[2], k.shape[2], seed, offset, torch.empty(0)


def _flash_backward(
    dout, q, k, v, out, lse, cq, ck, mq, mk, p, causal, seed, offset, *, scale=None
):
    assert cq is None and mq == q.shape[2] and mk == k.shape[2]
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, p, causal, scale=scale
    )


class EmulatedCudaOps:
    """torch.ops.aten with the CUDA attention ops replaced by CPU emulations (set as
    `kernels.aten`)."""

    TABLE = {
        "_scaled_dot_product_efficient_attention": _efficient,
        "_scaled_dot_product_efficient_attention_backward": _efficient_backward,
        "_scaled_dot_product_flash_attention": _flash,
        "_scaled_dot_product_flash_attention_backward": _flash_backward,
    }

    def __getattr__(self, name):
        return self.TABLE.get(name) or getattr(aten, name)


@pytest.mark.parametrize("kernel", kernels.KERNELS)
@pytest.mark.parametrize("causal", [True, False])
def test_each_kernels_block_and_gradients_equal_grouped_query_sdpa(kernel, causal, monkeypatch):
    monkeypatch.setattr(kernels, "aten", EmulatedCudaOps())
    gen = torch.Generator().manual_seed(3)
    b, h, hk, s, d = 2, 8, 2, 20, 8
    q = torch.randn(b, h, s, d, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(b, hk, s, d, generator=gen, dtype=torch.float64) for _ in "kv")
    weight = torch.randn(b, h, s, d, generator=gen, dtype=torch.float64)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*full, is_causal=causal, enable_gqa=True)
    (want * weight).sum().backward()
    out, lse = kernels.block(q, k, v, causal, kernel)
    assert lse.shape == (b, h, s)
    scores = (q @ k.repeat_interleave(h // hk, 1).transpose(-2, -1)) / math.sqrt(d)
    if causal:
        scores = scores.masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), -math.inf)
    assert torch.allclose(lse.to(torch.float64), torch.logsumexp(scores, -1), atol=1e-10)
    grads = kernels.block_backward(weight, q, k, v, out, lse, causal, kernel)
    assert (out - want).abs().max() < 1e-10
    for got, ref in zip(grads, full, strict=True):
        assert got.shape == ref.shape
        assert (got - ref.grad).abs().max() < 1e-10, kernel
