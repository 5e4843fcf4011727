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
node and InfiniBand NDR across. Their machines differ from the datasheet part (HBM2e, 96 GB,
500 W: "between SXM and NVL", their footnote); that is left as it is. Their selective
checkpointing (recomputing about every other matmul of forward) is not counted; full
checkpointing is (one more forward per layer, counted).

Run: python -m benchmarks.plan_vs_published (about a minute on two cores).
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
    # (name, model, gpus, fsdp, tp, local batch, full AC, matmul dtype, published tokens/s/GPU)
    ("Llama 3.1 8B, 8 x H100, FSDP, bf16", "8B", 8, 8, 1, 2, False, "bf16", 5762.0),
    ("Llama 3.1 70B, 256 x H100, FSDP 32 x TP 8, bf16", "70B", 256, 32, 8, 16, True, "bf16", 876.0),
    ("Llama 3.1 70B, 256 x H100, FSDP 32 x TP 8, fp8", "70B", 256, 32, 8, 16, True, "fp8", 876.0),
]


def count(shape: dict, batch: int, full_ac: bool) -> tuple[Work, int]:
    """One replica's forward and backward on `batch` x SEQ tokens, counted on fake tensors;
    and the parameter count."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from framework.preflight.fakes import fake_mode

    config = LlamaConfig(
        vocab_size=128256, max_position_embeddings=SEQ, rope_theta=500000.0, **shape
    )
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
        if full_ac:
            model.gradient_checkpointing_enable({"use_reentrant": False})
        ids = torch.randint(0, 128256, (batch, SEQ))
    params = sum(p.numel() for p in model.parameters())
    counter = counting_mode()
    with mode, counter:
        model(input_ids=ids, labels=ids).loss.backward()
    return Work(counter.flops, counter.bytes, counter.ops, batch * SEQ, batch), params


def layout(gpus: int, fsdp: int, tp: int, batch: int, params: int, shape: dict, dtype: str):
    """The facts `predict` takes, from the plan's formulas (framework/preflight/plan.py)."""
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
    for name, model, gpus, fsdp, tp, batch, full_ac, dtype, published in ROWS:
        key = (model, batch, full_ac)
        if key not in counted:
            counted[key] = count(LLAMA_31[model], batch, full_ac)
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
        shown = ", ".join(f"{k} {v:.3g}" for k, v in terms.items() if v)
        print(
            f"{name:52} {per_gpu:9.0f} {published:9.0f} {per_gpu / published:6.2f}  "
            f"{p.dominant} ({shown}; FLOPs alone {matmul:.3g})"
        )
    print(f"counted and predicted in {time.perf_counter() - started:.0f} s")
    save_results("plan_vs_published", {"rows": results}, load)


if __name__ == "__main__":
    main()
