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

Loading (`--section load`, also part of the default `all`): a Llama of LOAD_MODEL's shape
(272.7 MB of fp32 weights) written by the benchmark with `save_pretrained` into safetensors
shards of LOAD_SHARD, then read three ways, each in a fresh process: `from_pretrained` on one
process (the reference), `fw train task=hf_lm task.model.pretrained=DIR` under fsdp=2 and on one
process (one step each). Per rank: the seconds and the peak resident memory above where loading
started (the framework's run_dir/pretrained/rank<R>.json; for from_pretrained the same
/proc/self high-water mark around the call, and again once every weight has been read: its
weights are views of the memory-mapped files, whose pages become resident only when a step
first reads them, so right after the call it shows about half the model). Goal: RSS per rank
at fsdp=2 <= 0.65x from_pretrained's (with its weights read). Results:
benchmarks/results/hf_load.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

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


LOAD_MODEL = {  # 68.2 M parameters, 272.7 MB in fp32
    "vocab_size": 8192,
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "max_position_embeddings": 128,
}
LOAD_SHARD = "50MB"
FROM_PRETRAINED = """
import json, sys, time, torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM  # imported before the clock
from framework.integrations.hf.pretrained import peak_rss, reset_peak_rss
start, rss0 = time.perf_counter(), reset_peak_rss()
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
loaded = {"peak_rss_delta": peak_rss() - rss0, "seconds": time.perf_counter() - start}
with torch.no_grad():  # a first step reads every weight: the mapped file's pages come in
    sum(float(p.sum()) for p in model.parameters())
print(json.dumps([loaded, {"peak_rss_delta": peak_rss() - rss0, "seconds": loaded["seconds"]}]))
"""


def write_load_model(directory: Path) -> int:
    """The benchmark's Llama (random init, seed 0) as sharded safetensors; its weight bytes."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**LOAD_MODEL))
    model.save_pretrained(directory, max_shard_size=LOAD_SHARD)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def fw_load(directory: Path, tmp: str, strategy: str, devices: int) -> list[dict]:
    """One step of hf_lm from `directory`; each rank's loading report."""
    run = f"{tmp}/run-{strategy}-{devices}"
    args = ["task=hf_lm", f"task.model.pretrained={directory}", "task.data.tokenizer=bytes"]
    args += ["task.data.block_size=32", "task.data.batch_size=1", "task.data.max_bytes=100000"]
    run_checked(train_command(run, 1, devices, *args, f"strategy={strategy}"), strategy)
    return [json.loads(p.read_text())[0] for p in sorted(Path(run).glob("pretrained/rank*.json"))]


def loading() -> dict:
    """from_pretrained on one process against fw's loading under fsdp=2 and on one process."""
    with tempfile.TemporaryDirectory(prefix="fw-bench-hf-load-") as tmp:
        directory = Path(tmp) / "llama"
        weights = write_load_model(directory)
        done = subprocess.run(
            [sys.executable, "-c", FROM_PRETRAINED, str(directory)],
            capture_output=True,
            text=True,
            check=True,
        )
        right_after, reference = json.loads(done.stdout.strip().splitlines()[-1])
        rows = {"from_pretrained, 1 process": [reference]}
        rows["(the same, right after the call)"] = [right_after]
        rows["fw fsdp=2"] = fw_load(directory, tmp, "fsdp", 2)
        rows["fw, 1 process"] = fw_load(directory, tmp, "ddp", 1)
        files = len(list(directory.glob("*.safetensors")))
    print(f"Loading a {weights / 1e6:.1f} MB fp32 Llama ({files} safetensors files)")
    print(f"{'how':<34} rank  peak RSS rise (MB)  x from_pretrained  seconds")
    for how, ranks in rows.items():
        for rank, r in enumerate(ranks):
            ratio = r["peak_rss_delta"] / reference["peak_rss_delta"]
            print(
                f"{how:<34} {rank:>4} {r['peak_rss_delta'] / 1e6:>19.1f} {ratio:>18.2f} "
                f"{r['seconds']:>8.2f}"
            )
    worst = max(r["peak_rss_delta"] for r in rows["fw fsdp=2"])
    return {
        "model": LOAD_MODEL,
        "weight_bytes": weights,
        "files": files,
        "rows": rows,
        "fsdp2_worst_rank_over_from_pretrained": round(worst / reference["peak_rss_delta"], 3),
        "goal": 0.65,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1, help="runs of each model and layout")
    parser.add_argument(
        "--section", choices=["all", "step", "load"], default="all", help="what to measure"
    )
    options = parser.parse_args()
    repeats = options.repeats
    load_at_start = load_average()
    if options.section in ("all", "load"):
        save_results("hf_load", loading(), load_at_start)
        if options.section == "load":
            return
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
