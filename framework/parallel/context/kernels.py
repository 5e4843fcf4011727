"""One block of context-parallel attention on the device's fused kernel: its output and the
log-sum-exp of its scores (what the ring and allgather modes merge blocks by), never the block's
(s_q, s_k) score matrix; and the block's gradients, given the output and log-sum-exp of the
whole attention.

Which kernel (`kernel_for`, from the query's device, dtype and head size only):

- `cpu`: torch's fused CPU kernel (`_scaled_dot_product_flash_attention_for_cpu`);
- `flash`: CUDA's FlashAttention-2 (fp16 and bf16, head size a multiple of 8 up to 256, sm80+);
- `efficient`: CUDA's memory-efficient kernel (fp16, bf16 and fp32; the others on CUDA but fp64);
- `math`: plain torch operations that keep the block's scores (fp64 on CUDA, other devices).

The `meta` device counts as CUDA: `fw check` stands it in for the rank's GPU, so the check runs
the kernels a GPU would.

Grouped-query attention: K/V come with fewer heads than Q (each K/V head serves `groups` query
heads) and travel around the ring that way. The CPU and flash kernels take them as they are;
for the efficient kernel (its backward requires equal head counts) and the math one they are
repeated here, for the one block, and the gradients of the repeated heads are summed back onto
their K/V head, so the gradients that travel have the K/V's own head count too.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

aten = torch.ops.aten
HALF = (torch.float16, torch.bfloat16)
KERNELS = ("cpu", "flash", "efficient", "math")
TAKES_FEWER_KV_HEADS = {"cpu": True, "flash": True, "efficient": False, "math": False}
LSE_ROWS = 32  # the efficient kernel pads its log-sum-exp to a multiple of this many positions


def kernel_for(q: torch.Tensor) -> str:
    """The kernel a block of these queries runs on (one of KERNELS)."""
    device = q.device.type
    if device == "cpu":
        return "cpu"
    if device in ("cuda", "meta"):
        d = q.shape[-1]
        if q.dtype in HALF and d % 8 == 0 and d <= 256 and _enabled("flash", q.device):
            return "flash"
        aligned = d % 8 == 0 if q.dtype in HALF else d % 4 == 0
        if q.dtype in (*HALF, torch.float32) and aligned and _enabled("efficient", q.device):
            return "efficient"
    return "math"


def _enabled(kernel: str, device: torch.device) -> bool:
    """Whether this GPU runs the kernel and torch has it on; a device that is not a real GPU
    (meta, a fake CUDA tensor on a machine without one) stands for a current GPU: yes."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return True
    if kernel == "flash":
        major, _ = torch.cuda.get_device_capability(device)
        return torch.backends.cuda.flash_sdp_enabled() and major >= 8
    return torch.backends.cuda.mem_efficient_sdp_enabled()


def block(q, k, v, causal: bool, kernel: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(output (b, h, s_q, d) in q's dtype, log-sum-exp (b, h, s_q) in fp32 or fp64) of the
    queries over one block of keys and values (with their own, possibly fewer, heads)."""
    k, v = _heads(kernel, q, k, v)
    q, k, v = (t.contiguous() for t in (q, k, v))
    scale = 1.0 / math.sqrt(q.shape[-1])
    if kernel == "cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    if kernel == "flash":
        out, lse, *_ = aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=scale
        )
        return out, lse
    if kernel == "efficient":
        out, lse, _, _ = aten._scaled_dot_product_efficient_attention(
            q, k, v, None, True, 0.0, causal, scale=scale
        )
        return out, lse.narrow(-1, 0, q.shape[2])  # its padding left out of the merge
    scores = _scores(q, k, causal, scale)
    lse = torch.logsumexp(scores, dim=-1)
    return (torch.exp(scores - lse.unsqueeze(-1)).to(v.dtype) @ v), lse


def block_backward(dout, q, k, v, out, lse, causal: bool, kernel: str):
    """(dq, dk, dv) of one block, given the whole attention's output (q's dtype) and log-sum-exp
    (the softmax's normalisation over every block); dk and dv have k's head count."""
    kv_heads = k.shape[1]
    k, v = _heads(kernel, q, k, v)
    dout, q, k, v, out, lse = (t.contiguous() for t in (dout, q, k, v, out, lse))
    scale = 1.0 / math.sqrt(q.shape[-1])
    if kernel == "cpu":
        dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale
        )
    elif kernel == "flash":  # no dropout: the random state it would replay is not read
        seed = torch.empty(2, dtype=torch.uint64, device=q.device)
        offset = torch.empty((), dtype=torch.uint64, device=q.device)
        dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, None, None, q.shape[2], k.shape[2], 0.0, causal, seed,
            offset, scale=scale,
        )  # fmt: skip
    elif kernel == "efficient":
        seed = torch.empty((), dtype=torch.long, device=q.device)
        padded = F.pad(lse, (0, -lse.shape[-1] % LSE_ROWS))  # the layout its forward returns
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
            dout, q, k, v, None, out, padded, seed, seed, 0.0, [True, True, True, False], causal,
            scale=scale,
        )  # fmt: skip
    else:
        dq, dk, dv = _math_backward(dout, q, k, v, out, lse, causal, scale)
    if dk.shape[1] != kv_heads:  # each repeated head's gradient back onto its K/V head
        dk, dv = (t.unflatten(1, (kv_heads, -1)).sum(2) for t in (dk, dv))
    return dq, dk, dv


def _heads(kernel: str, q, k, v):
    """k and v with as many heads as the kernel needs: theirs, or repeated to q's."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1 and not TAKES_FEWER_KV_HEADS[kernel]:
        k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
    return k, v


def _scores(q, k, causal: bool, scale: float) -> torch.Tensor:
    """The block's scaled scores in fp32 at least, the causal mask applied (a diagonal block's
    queries and keys are the same positions)."""
    scores = (q @ k.transpose(-2, -1)).to(torch.promote_types(q.dtype, torch.float32)) * scale
    if causal:
        keep = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    return scores


def _math_backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    """FlashAttention's backward in plain operations: the probabilities rebuilt from the scores
    and the whole attention's log-sum-exp, `delta` the rows of dout * out."""
    p = torch.exp(_scores(q, k, causal, scale) - lse.unsqueeze(-1))
    dv = p.to(dout.dtype).transpose(-2, -1) @ dout
    dp = (dout @ v.transpose(-2, -1)).to(p.dtype)
    delta = (dout.to(p.dtype) * out.to(p.dtype)).sum(-1, keepdim=True)
    ds = (p * (dp - delta) * scale).to(q.dtype)
    return ds @ k, ds.transpose(-2, -1) @ q, dv
