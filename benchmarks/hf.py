"""A transformers model against the same-shaped framework.nn model: step time under ddp, fsdp and
tensor parallel, side by side (the ratio hf / framework.nn; goal: at most 1.10).

The two models, trained on the same bytes of the same corpus (vocabulary 256), fp32 on CPU:
- framework.nn: the gpt recipe (`task=gpt`): 4 blocks, width 256, 4 heads, MLP 4 x 256, GELU,
  LayerNorm, learned positions, head tied to the embedding;
- transformers: the hf_lm recipe (`task=hf_lm`) with a random-init `LlamaForCausalLM` of the same
  depth, width and heads (4 key/value heads), a SwiGLU MLP of 682 (3 x 682 x 256 weights per
  layer against the gpt's 2 x 1024 x 256), RMSNorm, rotary positions, an untied head (+65k
  parameters, 2%).
Sequences of 128, a global batch of 8 per step: ddp and fsdp on 2 processes (4 sequences each),
tensor parallel tp = 2 (the 2 processes share each batch of 8). Each run trains 20 steps;
`StepTimer` gives rank 0's median step over steps 5-20. The two models of one layout run one
after the other, the first alternating from layout to layout (and from repeat to repeat), so a
change in the machine's load falls on both. Run: `python -m benchmarks.hf [--repeats N]` (part
of `make bench`; about 3 minutes per repeat on 2 cores at load 4).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

from benchmarks.common import (
    load_average,
    run_checked,
    save_results,
    step_durations,
    step_timer_args,
    train_command,
)

LAYERS, WIDTH, HEADS, SEQ, GLOBAL_BATCH, LLAMA_MLP = 4, 256, 4, 128, 8, 682
MODELS = {
    "framework.nn": [
        "task=gpt",
        f"task.model.n_layer={LAYERS}",
        f"task.model.n_embd={WIDTH}",
        f"task.model.n_head={HEADS}",
        f"task.model.block_size={SEQ}",
        "task.model.sample_length=0",
        "task.data.max_bytes=400000",
    ],
    "transformers": [
        "task=hf_lm",
        "task.model.config={vocab_size:256,"
        f"hidden_size:{WIDTH},intermediate_size:{LLAMA_MLP},num_hidden_layers:{LAYERS},"
        f"num_attention_heads:{HEADS},num_key_value_heads:{HEADS},"
        f"max_position_embeddings:{SEQ}}}",
        f"task.data.block_size={SEQ}",
        "task.data.max_bytes=400000",
    ],
}
# name, strategy args, data-parallel degree (how many ways the global batch is split)
LAYOUTS = [
    ("ddp x2", ["strategy=ddp"], 2),
    ("fsdp x2", ["strategy=fsdp"], 2),
    ("tp=2", ["strategy=tensor"], 1),
]
STEPS, WARMUP = 20, 5


def median_step(model: str, args: list[str], dp: int) -> float:
    with tempfile.TemporaryDirectory(prefix="fw-bench-hf-") as tmp:
        command = train_command(
            f"{tmp}/run",
            STEPS,
            2,
            *MODELS[model],
            *args,
            f"task.data.batch_size={GLOBAL_BATCH // dp}",
            *step_timer_args(tmp),
        )
        run_checked(command, f"{model} {' '.join(args)}")
        return statistics.median(step_durations(tmp)[WARMUP:])


def parameters() -> dict[str, int]:
    """Each model's parameter count (built on the meta device)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from recipes.gpt.model import GPT

    with torch.device("meta"):
        gpt = GPT(256, SEQ, LAYERS, HEADS, WIDTH, 0.0)
        llama = LlamaForCausalLM(
            LlamaConfig(
                vocab_size=256,
                hidden_size=WIDTH,
                intermediate_size=LLAMA_MLP,
                num_hidden_layers=LAYERS,
                num_attention_heads=HEADS,
                num_key_value_heads=HEADS,
                max_position_embeddings=SEQ,
            )
        )
    return {
        "framework.nn": sum(p.numel() for p in gpt.parameters()),
        "transformers": sum(p.numel() for p in llama.parameters()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1, help="runs of each model and layout")
    repeats = parser.parse_args().repeats
    load_at_start = load_average()
    times: dict[tuple[str, str], list[float]] = {}
    turn = 0
    for _ in range(repeats):
        for name, args, dp in LAYOUTS:
            order = list(MODELS) if turn % 2 == 0 else list(reversed(MODELS))
            turn += 1
            for model in order:
                times.setdefault((name, model), []).append(median_step(model, args, dp))
    counts = parameters()
    print(
        f"{LAYERS} layers x {WIDTH}, {HEADS} heads, s = {SEQ}, global batch {GLOBAL_BATCH}; "
        f"CPU, fp32; parameters: framework.nn {counts['framework.nn']:,}, "
        f"transformers {counts['transformers']:,}"
    )
    print("layout     framework.nn (ms)  transformers (ms)  hf / framework.nn")
    rows = []
    for name, _, _ in LAYOUTS:
        ours = statistics.median(times[(name, "framework.nn")])
        theirs = statistics.median(times[(name, "transformers")])
        ratio = theirs / ours
        rows.append(
            {
                "layout": name,
                "framework_nn_step_s": ours,
                "transformers_step_s": theirs,
                "ratio": round(ratio, 3),
                "runs": {m: times[(name, m)] for m in MODELS},
            }
        )
        print(f"{name:<10} {ours * 1e3:>17.1f} {theirs * 1e3:>18.1f} {ratio:>18.3f}")
    results = {
        "models": MODELS,
        "parameters": counts,
        "global_batch": GLOBAL_BATCH,
        "steps": STEPS,
        "warmup": WARMUP,
        "repeats": repeats,
        "rows": rows,
    }
    save_results("hf", results, load_at_start)


if __name__ == "__main__":
    main()
