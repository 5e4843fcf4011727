"""The rates `fw calibrate` (framework/preflight/calibrate.py) measures in every process at
once, as the job's ranks compete for the cores: matmul FLOP/s by dtype (a square probe) and the
share of it a transformer's linear layers reach by their size, a large copy's bandwidth, the
cost of one small operation, the rate of the operations without a FLOP formula by their size,
and fused attention's FLOP/s by dtype. Each is the median of windows of about 0.1 s
(`time_per_call`), as a measured step is the median of its windows."""

from __future__ import annotations

import statistics
import time

MATMUL = 512  # square matmuls of this size: a small transformer's per-rank shapes
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
ATTENTION = (4, 4, 256, 32)  # batch, heads, sequence, head width: the attention probe's q, k, v
# the matmul probe's layer widths (its sizes) and tokens: a transformer layer's linears
LINEAR_WIDTHS = (64, 128, 256, 512)
LINEAR_TOKENS = 1024
# the elementwise probe: tokens (its sizes), width, and the MLP's and the logits' width
ELEMENTWISE_TOKENS = (64, 256, 1024, 4096)
ELEMENTWISE_WIDTHS = (256, 1024, 1024)


def times_of(run, repeats: int = 5) -> list[float]:
    run()  # warm-up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return times


def typical_time(run, repeats: int = 5) -> float:
    """The median time of `run` after a warm-up. A measured step is the median of its windows
    (framework/preflight/measure.py), so its parts are priced at their median too, not at the
    fastest of the repeats: between processes sharing cores a collective waits for its peer
    to be scheduled, and the luckiest repeat hides that (both are kept for the all-reduce)."""
    return statistics.median(times_of(run, repeats))


def time_per_call(call, window_s: float = 0.1, repeats: int = 7) -> float:
    """Seconds per `call`, the median of `repeats` windows of about `window_s` each (as many
    calls as fill one, from a timed first call): a window spans many scheduling slices, not
    the one or two of a few milliseconds' work."""
    started = time.perf_counter()
    call()
    calls = max(1, round(window_s / max(time.perf_counter() - started, 1e-9)))
    return typical_time(lambda: [call() for _ in range(calls)], repeats) / calls


def compute_rates(torch, together) -> dict:
    """Matmul TFLOP/s by dtype, a large copy's GB/s and a small operation's seconds, each
    started in every process at once (`together`: a barrier), as a job's ranks compete."""
    rates = {}
    for name, dtype in DTYPES.items():
        a = torch.randn(MATMUL, MATMUL, dtype=getattr(torch, dtype))
        b = torch.randn(MATMUL, MATMUL, dtype=getattr(torch, dtype))
        together()
        seconds = time_per_call(lambda a=a, b=b: a @ b)
        rates[name] = 2 * MATMUL**3 / seconds / 1e12
    big = torch.ones(2**24)  # 64 MiB: past the caches
    copy = torch.empty_like(big)
    together()
    seconds = time_per_call(lambda: copy.copy_(big))
    small = torch.ones(8)
    together()
    ops = time_per_call(lambda: small.add(1))
    attention = {name: attention_rate(torch, dtype, together) for name, dtype in DTYPES.items()}
    return {
        "tflops": rates,
        "attention_tflops": attention,
        "copy_gb_per_s": 2 * big.numel() * 4 / seconds / 1e9,
        "op_s": ops,
        "elementwise_gb_per_s": elementwise_rates(torch, together, ops),
        "matmul_share": {
            size: rate / 1e12 / rates["fp32"]
            for size, rate in linear_rates(torch, together).items()
        },
    }


def linear_rates(torch, together) -> dict[str, float]:
    """FLOP/s of the matmuls a transformer layer's linears (width d to 3d, d, 4d and back from
    4d) run in forward and backward, as the step issues them (weights transposed, a bias
    added, the gradients' transposed products), by the FLOPs of one call (the key), for
    several widths. Recorded once, then replayed alone: the rate of those calls, which on
    this CPU is below a square matmul's (the weight gradients' short sides)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import flop_registry

    calls = []

    class Recording(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            formula = flop_registry.get(func._overloadpacket)
            if formula is not None:
                kept = [a.detach().clone() if torch.is_tensor(a) else a for a in args]
                calls.append(
                    (func, kept, kwargs or {}, formula(*args, **(kwargs or {}), out_val=out))
                )
            return out

    rates = {}
    for width in LINEAR_WIDTHS:
        torch.manual_seed(0)
        widths = [(width, 3 * width), (width, width), (width, 4 * width), (4 * width, width)]
        layers = [torch.nn.Linear(a, b) for a, b in widths]
        calls.clear()
        with Recording():
            for layer in layers:
                layer(
                    torch.randn(LINEAR_TOKENS, layer.in_features, requires_grad=True)
                ).sum().backward()
        recorded = list(calls)

        def replay(recorded=recorded):
            for func, args, kwargs, _ in recorded:
                func(*args, **kwargs)

        together()
        flops = sum(c[3] for c in recorded)
        rates[str(round(flops / len(recorded)))] = flops / time_per_call(replay)
    return rates


def elementwise_rates(torch, together, op_s: float) -> dict[str, float]:
    """GB/s of a transformer's operations without a FLOP formula (a layer norm, GELU, a
    residual add and a softmax cross-entropy, forward and backward), by the bytes one of them
    moves (the key), at several sizes: their bytes as `fw plan` counts a step's
    (framework.preflight.replica.counting_mode) over their time less their launches (`op_s`
    each, which the plan charges apart). On this CPU they run at about half a large copy's
    rate (GELU's erf is arithmetic), faster where a tensor fits the caches."""
    import torch.nn.functional as F

    from framework.preflight.replica import counting_mode

    width, hidden, vocab = ELEMENTWISE_WIDTHS
    rates = {}
    for tokens in ELEMENTWISE_TOKENS:
        torch.manual_seed(0)
        x = torch.randn(tokens, width, requires_grad=True)
        weight, bias = torch.ones(width, requires_grad=True), torch.zeros(width, requires_grad=True)
        h = torch.randn(tokens, hidden, requires_grad=True)
        logits = torch.randn(tokens, vocab, requires_grad=True)
        targets = torch.randint(0, vocab, (tokens,))

        def run(x=x, weight=weight, bias=bias, h=h, logits=logits, targets=targets):
            normed = F.layer_norm(x, (x.shape[-1],), weight, bias)
            loss = F.cross_entropy(logits, targets) + F.gelu(h).sum() + (x + normed).sum()
            loss.backward()
            for t in (x, weight, bias, h, logits):
                t.grad = None

        counter = counting_mode()
        with counter:
            run()
        together()
        seconds = time_per_call(run) - counter.ops * op_s
        each = counter.bytes / counter.other_ops
        rates[str(round(each))] = counter.bytes / max(seconds, 1e-9) / 1e9
    return rates


def attention_rate(torch, dtype: str, together) -> float:
    """TFLOP/s of causal fused attention, forward and backward (ATTENTION's shape), its FLOPs
    counted as `fw plan` counts a step's (framework.preflight.replica.counting_mode)."""
    from framework.preflight.replica import counting_mode

    torch.manual_seed(0)
    q, k, v = (
        torch.randn(*ATTENTION, dtype=getattr(torch, dtype), requires_grad=True) for _ in range(3)
    )

    def run():
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.sum().backward()
        q.grad = k.grad = v.grad = None

    counter = counting_mode()
    with counter:
        run()
    together()
    return counter.attention_flops / time_per_call(run) / 1e12
