"""How a rank's memory grows with the work of loading: a resume that halves the process count, a
pretrained load, and `fw export`, each beside the ideal as a ratio.

For each model size (a gpt of ~25 M and ~100 M parameters: fp32 weights and AdamW's two moments
make the training state, 12 bytes a parameter) and each process count N:
- resume: the job trains one step on 2N processes (checkpoint at step 1), then resumes on N
  under the same strategy (fsdp, zero3, tensor); each rank's resume report
  (run_dir/resume/rank<R>.json) gives the bytes it keeps of the checkpoint (`held`), the bytes
  the kernel counted it read (`io_read`) and its high-water mark's rise while reading;
- pretrained: a Llama of the same size written with save_pretrained, loaded under the same
  strategies on N processes (run_dir/pretrained/rank<R>.json);
- export: `fw export` of the resumed fsdp checkpoint, its peak above where it started less that
  of exporting a tiny gpt's fsdp checkpoint (what any export costs: the reader's imports and
  buffers), against the model's weights and its largest tensor.
The ideal of a rank is state / N (what it must keep) plus the largest tensor (what a reader may
hold at once). Printed per case: held / (state / N), read / held, and (held + the rise beyond
it) / ideal. Results: benchmarks/results/scale_memory.json.

Run: `python -m benchmarks.scale_memory [--sizes 25,100] [--procs 1,2] [--strategies fsdp,zero3,tensor]` (part of `make bench`;
N = 4 means 8 processes for the training run: `--procs 1,2,4` on a machine with the memory).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from benchmarks.common import FW, load_average, run_checked, save_results

# heads a multiple of 4: the tensor-parallel runs split them over up to 4 writing processes
SIZES = {
    25: {"n_layer": 6, "n_embd": 576, "n_head": 12},
    100: {"n_layer": 8, "n_embd": 1024, "n_head": 16},
}
TINY = {"n_layer": 1, "n_embd": 64, "n_head": 4}  # the export's baseline
STRATEGIES = ("fsdp", "zero3", "tensor")
COMMON = [
    "task.data.block_size=64",
    "task.data.max_bytes=100000",
    "task.data.batch_size=2",
    "trainer.limit_val_batches=0",
    "trainer.enable_progress_bar=false",
    "trainer.enable_model_summary=false",
    "logger=[csv]",
    "callbacks.checkpoint.every_n_steps=1",
]


def gpt_args(size: int) -> list[str]:
    model = [f"task.model.{k}={v}" for k, v in SIZES[size].items()]
    return ["task=gpt", "task.model.block_size=64", *model]


def state_bytes(size: int) -> tuple[int, int]:
    """(training state, largest tensor) of the gpt of that size, in bytes (built on meta)."""
    import torch
    from omegaconf import OmegaConf

    from framework.config.compose import compose_config
    from framework.instantiate import build_task

    cfg = compose_config([*COMMON, *gpt_args(size)])
    with torch.device("meta"):
        task = build_task(OmegaConf.create(OmegaConf.to_container(cfg.task, resolve=True)))
    params = list(task.parameters())
    return sum(p.numel() for p in params) * 12, max(p.numel() for p in params) * 4


def resume_case(root: Path, size: int, strategy: str, n: int) -> dict:
    run = root / f"{strategy}-{size}-{n}"
    args = [FW, "train", *COMMON, *gpt_args(size), f"strategy={strategy}", f"run.dir={run}"]
    run_checked([*args, f"trainer.devices={2 * n}", "trainer.max_steps=1"], f"{run} write")
    run_checked([*args, f"trainer.devices={n}", "trainer.max_steps=2"], f"{run} resume")
    ranks = []
    for rank in range(n):
        phases = json.loads((run / "resume" / f"rank{rank}.json").read_text())
        held = sum(p["held"] for p in phases)
        beyond = max(max(p["peak_rise"] - p["held"], 0) for p in phases)
        ranks.append({"held": held, "io_read": sum(p["io_read"] for p in phases), "beyond": beyond})
    return {"run": str(run), "ranks": ranks}


def pretrained_case(root: Path, directory: Path, strategy: str, n: int) -> dict:
    run = root / f"pretrained-{directory.name}-{strategy}-{n}"
    args = [FW, "train", *COMMON, "task=hf_lm", f"task.model.pretrained={directory}"]
    args += ["task.data.tokenizer=bytes", f"strategy={strategy}", f"trainer.devices={n}"]
    run_checked([*args, "trainer.max_steps=1", f"run.dir={run}"], run)
    ranks = []
    for rank in range(n):
        (report,) = json.loads((run / "pretrained" / f"rank{rank}.json").read_text())
        held = report["local_bytes"]
        if "peak_rise" in report:  # zero3: read into DeepSpeed's partitions, allocated before
            beyond = report["peak_rise"]
        else:  # the rank's parameters are allocated while loading: its rise includes them
            beyond = max(report["peak_rss_delta"] - held, 0)
        ranks.append({"held": held, "io_read": report["io_read"], "beyond": beyond})
    return {"run": str(run), "ranks": ranks}


def llama(root: Path, size: int) -> Path:
    """A Llama with about the gpt's parameters, saved in shards of 50 MB."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = SIZES[size]
    width = shape["n_embd"]
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=width,
        intermediate_size=int(width * 8 / 3) // 16 * 16,
        num_hidden_layers=shape["n_layer"],
        num_attention_heads=shape["n_head"],
        num_key_value_heads=shape["n_head"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    path = root / f"llama{size}"
    LlamaForCausalLM(config).save_pretrained(path, max_shard_size="50MB")
    return path


# `fw export` in a process of its own, its imports paid before the high-water mark is reset (an
# export run earlier in the same process would leave the allocator holding its memory, and the
# second one's rise would read as nothing)
EXPORT = """
import json, sys
import torch
import framework.checkpoint.export, framework.checkpoint.formats, framework.checkpoint.load
from framework.cli import main
from framework.memory import peak_rss, reset_peak_rss
start = reset_peak_rss()
code = main(["export", sys.argv[1], sys.argv[2]])
print(json.dumps({"code": code, "peak_rise": peak_rss() - start}))
"""


def export_case(ckpt: Path, out: Path) -> dict:
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", EXPORT, str(ckpt), str(out)], capture_output=True, text=True
    )
    if done.returncode != 0:
        raise RuntimeError(f"export of {ckpt} failed:\n{done.stderr[-3000:]}")
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["code"] == 0, done.stderr[-3000:]
    return {"peak_rise": found["peak_rise"], "written": out.stat().st_size}


def export_baseline(root: Path) -> int:
    """The peak rise of exporting a tiny gpt's fsdp checkpoint (2 processes, one step)."""
    run = root / "tiny"
    model = [f"task.model.{k}={v}" for k, v in TINY.items()]
    args = [*COMMON, "task=gpt", "task.model.block_size=64", *model, "strategy=fsdp"]
    run_checked(
        [FW, "train", *args, "trainer.devices=2", "trainer.max_steps=1", f"run.dir={run}"], run
    )
    ckpt = run / "checkpoints" / "step00000001"
    return export_case(ckpt, root / "tiny.pt")["peak_rise"]


def ratios(case: dict, whole: int, largest: int, n: int) -> list[str]:
    ideal = whole / n
    rows = []
    for rank, r in enumerate(case["ranks"]):
        peak = (r["held"] + r["beyond"]) / (ideal + largest)
        rows.append(
            f"rank {rank}: held/(state/N) {r['held'] / ideal:.2f}, read/held "
            f"{r['io_read'] / max(r['held'], 1):.2f}, peak/(state/N + largest) {peak:.2f}"
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="25,100")
    parser.add_argument("--procs", default="1,2")
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    args = parser.parse_args()
    strategies = args.strategies.split(",")
    sizes = [int(s) for s in args.sizes.split(",")]
    procs = [int(p) for p in args.procs.split(",")]
    load_at_start = load_average()
    results: dict = {"resume": [], "pretrained": [], "export": []}
    baseline = 0
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for size in sizes:
            state, largest = state_bytes(size)
            weights = state // 3
            directory = llama(root, size)
            for strategy in strategies:
                for n in procs:
                    if strategy == "tensor" and n == 1:
                        continue  # one process has no tensor split
                    case = resume_case(root, size, strategy, n)
                    for line in ratios(case, state, largest, n):
                        print(f"resume {strategy} {size}M 2x{n}->{n} {line}", flush=True)
                    results["resume"].append({"size": size, "strategy": strategy, "n": n, **case})
                    case = pretrained_case(root, directory, strategy, n)
                    for line in ratios(case, weights, largest, n):
                        print(f"pretrained {strategy} {size}M x{n} {line}", flush=True)
                    results["pretrained"].append(
                        {"size": size, "strategy": strategy, "n": n, **case}
                    )
            if "fsdp" not in strategies:
                continue  # the export reads the fsdp resume's checkpoint
            ckpt = root / f"fsdp-{size}-{procs[-1]}" / "checkpoints" / "step00000002"
            found = export_case(ckpt, root / f"export{size}.pt")
            found["baseline"] = baseline = baseline or export_baseline(root)
            rise = found["peak_rise"] - baseline
            print(
                f"export {size}M: peak +{rise / 2**20:.1f} MiB beyond a tiny model's export "
                f"(+{baseline / 2**20:.1f} MiB) for {found['written'] / 2**20:.1f} MiB written: "
                f"{rise / weights:.2f}x the weights, {rise / largest:.2f}x the largest tensor",
                flush=True,
            )
            results["export"].append(
                {"size": size, "weights": weights, "largest": largest, **found}
            )
    save_results("scale_memory", results, load_at_start)


if __name__ == "__main__":
    main()
