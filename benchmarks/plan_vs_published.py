"""`fw plan`'s step-time model (framework/preflight/perf.py) against throughput torchtitan
publishes for H100s (benchmarks/llama3_h100_202412_torchtitan.md in pytorch/torchtitan):

- Llama 3.1 8B, 8 GPUs, FSDP, bf16, local batch 2 x 8192 tokens, selective activation
  checkpointing, no compile: 5,762 tokens/s per GPU (their Table 1).
- Llama 3.1 70B, 256 GPUs, FSDP 32 x TP 8, local batch 16 x 8192, full activation
  checkpointing, with torch.compile, Float8 linears and async TP: 876 tokens/s per GPU
  (their Table 4); predicted twice, with the matmuls in bf16 (what `fw train` would run) and in
  fp8 (what that run did).

The prediction uses the H100 SXM description as it is in framework/preflight/hardware.py (no
constant changed for these rows): the FLOPs and other operations' bytes of one replica's step
are counted on fake tensors (a transformers Llama of that shape, built on fake CPU tensors, bf16
parameters as FSDP's mixed precision computes them), the bytes per collective from the plan's
formulas (FSDP 3 x the bf16 parameters per data rank, 4bsh per layer for TP), over NVLink within a
node and InfiniBand NDR across. Their machines differ from the datasheet part (96 GB of HBM2e
at 2.4 TB/s, 500 W, as their benchmark page states, with a peak "between SXM and NVL" by its
footnote): each row is predicted again on that memory with either end of that peak, the H100
SXM's and the H100 NVL's datasheet figures (`their_part`). Checkpointing is counted as each run
configured it: the 8B run's selective checkpointing keeps the attention's and every second
matmul's outputs (`checkpoint_every_other_matmul`), the 70B run's full checkpointing recomputes
each layer's forward.

Run: python -m benchmarks.plan_vs_published (about 10 s on two cores).
"""

from __future__ import annotations

import time

import torch

from benchmarks.common import load_average, save_results
from framework.preflight.hardware import DEVICES, Device
from framework.preflight.perf import predict
from framework.preflight.replica import Work, counting_mode

LLAMA_31 = {
    "8B": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
           "num_attention_heads": 32, "num_key_value_heads": 8},
    "70B": {"hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
            "num_attention_heads": 64, "num_key_value_heads": 8},
}  # fmt: skip
SEQ = 8192
ROWS = [
    # (name, model, gpus, fsdp, tp, local batch, checkpointing, matmul dtype, published tok/s/GPU)
    ("Llama 3.1 8B, 8 x H100, FSDP, bf16", "8B", 8, 8, 1, 2, "every_other_matmul", "bf16", 5762.0),
    ("Llama 3.1 70B, 256 x H100, FSDP 32 x TP 8, bf16", "70B", 256, 32, 8, 16, "full", "bf16", 876.0),
    ("Llama 3.1 70B, 256 x H100, FSDP 32 x TP 8, fp8", "70B", 256, 32, 8, 16, "full", "fp8", 876.0),
]  # fmt: skip


def count(shape: dict, batch: int, checkpointing: str) -> tuple[Work, int]:
    """One replica's forward and backward on `batch` x SEQ tokens, counted on fake tensors,
    each decoder layer checkpointed as `trainer.activation_checkpointing=<checkpointing>` does
    (framework/parallel/transforms.py); and the parameter count."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from framework.parallel.transforms import checkpoint_block
    from framework.preflight.fakes import fake_mode

    config = LlamaConfig(
        vocab_size=128256,
        max_position_embeddings=SEQ,
        rope_theta=500000.0,
        use_cache=False,
        **shape,
    )  # no key/value cache in training (framework/parallel/transforms.py's keep_no_cache)
    config._attn_implementation = "sdpa"
    mode = fake_mode()
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # bf16 parameters, as FSDP's mixed precision computes
    try:
        with mode:
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    with mode:
        model.train()
        for layer in model.model.layers:
            if checkpointing == "every_other_matmul":
                checkpoint_every_other_matmul(layer)
            else:
                checkpoint_block(layer, checkpointing)
        ids = torch.randint(0, 128256, (batch, SEQ))
    params = sum(p.numel() for p in model.parameters())
    counter = counting_mode()
    with mode, counter:
        model(input_ids=ids, labels=ids).loss.backward()
    return Work(counter.flops, counter.bytes, counter.ops, batch * SEQ, batch), params


def checkpoint_every_other_matmul(layer) -> None:
    """Selective checkpointing as the published 8B run configures it (torchtitan's per-operation
    option): a layer keeps the outputs of its fused attention and of every second matmul, and
    recomputes the rest in backward. fw's own `selective` keeps every matmul's output."""
    from torch.utils.checkpoint import (
        CheckpointPolicy,
        checkpoint,
        create_selective_checkpoint_contexts,
    )

    from framework.preflight.replica import is_attention

    def contexts():
        seen = {False: 0, True: 0}  # matmuls met in forward and in the recompute, apart

        def policy(ctx, op, *args, **kwargs):
            name = op._overloadpacket.__name__
            if name == "mm":
                seen[ctx.is_recompute] += 1
                keep = seen[ctx.is_recompute] % 2 == 1
            else:
                keep = is_attention(name)
            return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

        return create_selective_checkpoint_contexts(policy)

    inner = layer.forward

    def forward(*args, **kwargs):
        return checkpoint(inner, *args, use_reentrant=False, context_fn=contexts, **kwargs)

    layer.forward = forward


def layout(gpus: int, fsdp: int, tp: int, batch: int, params: int, shape: dict, dtype: str):
    """The facts `predict` takes, from the plan's formulas (framework/preflight/planner.py)."""
    device = DEVICES["H100 SXM"]
    grads = 2 * params / tp / fsdp  # the rank's bf16 gradient shard
    act = batch * SEQ * shape["hidden_size"] * 2
    layers = shape["num_hidden_layers"]
    precision = "bf16-mixed" if dtype == "bf16" else dtype
    return {
        "tp": tp,
        "pp": 1,
        "precision": precision,
        "data_ranks": fsdp,
        "microbatches": 1,
        "virtual_stages": 1,
        "traffic": {
            "data": 3 * grads * fsdp,
            "tensor": 4 * act * layers if tp > 1 else 0.0,
            "pipeline": 0.0,
            "experts": 0.0,
        },
        "group_sizes": {"data": fsdp, "tensor": tp, "experts": 1, "pipeline": 1},
        "spans_nodes": {
            "data": gpus > device.gpus_per_node,
            "tensor": tp > device.gpus_per_node,
            "experts": False,
            "pipeline": False,
        },
        "tensor_collectives": 4 * layers,
        "expert_collectives": 0,
        "pipeline_receives": 0,
        # fp32 master parameters, gradients and Adam's two states, sharded
        "state_bytes": {"params": 2 * grads, "grads": 2 * grads, "optimizer": 4 * grads},
    }


def their_part(device: Device, peak: Device) -> Device:
    """The H100 SXM description with what their benchmark page states of its GPUs: 96 GB of
    HBM2e at 2.4 TB/s, and (its footnote 2: "HBM2e-based SXM H100 with lower TDP, the actual
    peak TFLOPs number is between SXM and NVL") the dense peaks of `peak`, the SXM's or the
    NVL's datasheet figures, the two ends of what they say; the SXM's efficiency either way
    (the same Hopper die and cuBLAS)."""
    return Device(**{**device.__dict__, "name": f"H100 (96 GB HBM2e, 2.4 TB/s, {peak.name} peak)",
                     "memory_gib": 96.0, "hbm_gb_per_s": 2400.0, "tflops": peak.tflops})  # fmt: skip


def matmul_peak(device: Device, dtype: str) -> Device:
    """The device with its `precision` name mapped for fp8 rows (perf reads bf16/fp16/fp32)."""
    if dtype != "fp8":
        return device
    return Device(**{**device.__dict__, "tflops": {**device.tflops, "fp32": device.tflops["fp8"]}})


def main() -> None:
    load = load_average()
    started = time.perf_counter()
    counted: dict[tuple, tuple[Work, int]] = {}
    results = []
    header = f"{'run':52} {'predicted':>9} {'published':>9} {'ratio':>6}  dominant term (s/step)"
    print(header)
    for name, model, gpus, fsdp, tp, batch, checkpointing, dtype, published in ROWS:
        key = (model, batch, checkpointing)
        if key not in counted:
            counted[key] = count(LLAMA_31[model], batch, checkpointing)
        work, params = counted[key]
        facts = layout(gpus, fsdp, tp, batch, params, LLAMA_31[model], dtype)
        device = matmul_peak(DEVICES["H100 SXM"], dtype)
        p = predict(work, facts, device)
        per_gpu = p.tokens_per_s / gpus
        terms = {
            "compute": p.compute_s,
            "communication": p.comm_s,
            "optimizer": p.optimizer_s,
            "bubble": p.bubble_s,
        }
        matmul = work.flops / tp / (device.peak(dtype if dtype != "fp8" else "fp32") * 0.7)
        results.append(
            {
                "run": name,
                "params": params,
                "flops_per_replica_step": work.flops,
                "other_bytes_per_replica_step": work.other_bytes,
                "ops": work.ops,
                "predicted_tokens_per_s_per_gpu": per_gpu,
                "published_tokens_per_s_per_gpu": published,
                "predicted_over_published": per_gpu / published,
                "step_s": p.step_s,
                "terms_s": terms,
                "matmul_s": matmul,
                "dominant": p.dominant,
                "mfu": p.mfu,
            }
        )
        for end in ("H100 SXM", "H100 NVL"):
            theirs = their_part(DEVICES["H100 SXM"], DEVICES[end])
            theirs = predict(work, facts, matmul_peak(theirs, dtype))
            results[-1][f"their_part_{end.split()[-1].lower()}_peak"] = {
                "predicted_tokens_per_s_per_gpu": theirs.tokens_per_s / gpus,
                "predicted_over_published": theirs.tokens_per_s / gpus / published,
                "compute_s": theirs.compute_s,
            }
        shown = ", ".join(f"{k} {v:.3g}" for k, v in terms.items() if v)
        print(
            f"{name:52} {per_gpu:9.0f} {published:9.0f} {per_gpu / published:6.2f}  "
            f"{p.dominant} ({shown}; FLOPs alone {matmul:.3g})"
        )
        for end in ("sxm", "nvl"):
            theirs = results[-1][f"their_part_{end}_peak"]
            print(
                f"{f'  their part (2.4 TB/s HBM2e, {end.upper()} peak)':52} "
                f"{theirs['predicted_tokens_per_s_per_gpu']:9.0f} {published:9.0f} "
                f"{theirs['predicted_over_published']:6.2f}  compute {theirs['compute_s']:.3g}"
            )
    print(f"counted and predicted in {time.perf_counter() - started:.0f} s")
    save_results("plan_vs_published", {"rows": results}, load)


if __name__ == "__main__":
    main()
