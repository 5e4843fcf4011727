"""Context parallel side by side (issue 28): step time, memory and the longest sequence.

Three sections (`--section steps|fit|llama|all`, default all):

- steps: a small gpt (`task=gpt`, 2 layers of width 128, 4 heads) at block_size 1024 and 2048
  on 2 CPU processes, the same global batch of 4 sequences per step: cp=1 (strategy=fsdp, each
  rank its own 2 sequences) against cp=2 with each cp_mode (both ranks the same 4 sequences,
  each half of every one). Per layout: the median step time of steps 3..8 (rank 0's StepTimer)
  and each rank's peak RSS rise over its RSS at the start of training (the PeakMemory callback
  below), with both as ratios to cp=1.
- fit: the longest block_size each layout fits in a fixed per-process budget (`--budget`,
  default 1 GiB), 2 sequences per data rank in every layout (a cp=2 rank holds half of each),
  by `fw check` on the fake backend (the worst rank's params + grads + optimizer +
  activations): doubling from 1024, then halving the gap to a step of 256.
- llama: the longest sequence one H100 (80 GiB, 90% usable as `fw plan` counts it) holds for a
  Llama-3-8B shape (transformers LlamaConfig: 32 layers, hidden 4096, MLP 14336, 32 heads, 8
  key/value heads, vocabulary 128256) over 8 ranks: strategy=fsdp (parameters, gradients and
  optimizer states sharded over the 8), cp = 1, 2, 4, 8 (ring), bf16-mixed, full activation
  checkpointing, one sequence per data rank; `fw check` on the fake backend, doubling from 8192
  positions, then halving the gap to 8192 x cp (searched up to 1M positions).

Results: benchmarks/results/context.json. Run from the repository root:
`python -m benchmarks.context` (or `make bench`).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import tempfile
import time
from pathlib import Path

import lightning.pytorch as pl

from benchmarks.common import (
    load_average,
    run_checked,
    save_results,
    step_durations,
    step_timer_args,
    train_command,
)

GPT = [
    "task=gpt",
    "task.model.n_layer=2",
    "task.model.n_embd=128",
    "task.model.n_head=4",
    "task.data.max_bytes=1000000",
    "trainer.log_every_n_steps=1",
]
# (name, overrides, sequences per rank): the same 4 sequences per step in every layout
LAYOUTS = [
    ("cp=1 (fsdp=2)", ["strategy=fsdp"], 2),
    ("ring", ["strategy=fsdp", "strategy.cp=2", "strategy.cp_mode=ring"], 4),
    ("allgather", ["strategy=fsdp", "strategy.cp=2", "strategy.cp_mode=allgather"], 4),
    ("ulysses", ["strategy=fsdp", "strategy.cp=2", "strategy.cp_mode=ulysses"], 4),
]
STEPS = 8
SKIP = 2  # warm-up steps left out of the median
GIB = 2**30
LLAMA_8B = {
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 1048576,
    "rope_theta": 500000.0,
}
H100 = "H100"
HEADROOM = 0.9  # of the device's memory, as fw plan counts it (framework/preflight/plan.py)


class PeakMemory(pl.Callback):
    """Writes this rank's RSS at the start of training and its peak RSS at the end (bytes)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.start = 0

    def on_train_start(self, trainer, pl_module) -> None:
        self.start = rss()

    def on_train_end(self, trainer, pl_module) -> None:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        out = Path(self.path.replace("RANK", str(trainer.global_rank)))
        out.write_text(json.dumps({"start": self.start, "peak": peak}))


def rss() -> int:
    """This process's resident set now, in bytes."""
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_steps(block: int) -> dict[str, dict]:
    """Each layout's step time and peak RSS rise at `block` positions per sequence."""
    found = {}
    for name, layout, rows in LAYOUTS:
        with tempfile.TemporaryDirectory(prefix="fw-bench-context-") as tmp:
            memory = [
                "+callbacks.peak._target_=benchmarks.context.PeakMemory",
                f"+callbacks.peak.path={tmp}/peak-RANK.json",
            ]
            args = [*GPT, f"task.model.block_size={block}", f"task.data.batch_size={rows}"]
            command = train_command(
                f"{tmp}/run", STEPS, 2, *args, *layout, *step_timer_args(tmp), *memory
            )
            started = time.perf_counter()
            run_checked(command, f"{name} at block_size {block}")
            wall = time.perf_counter() - started
            steps = step_durations(tmp)[SKIP:]
            peaks = [json.loads(Path(f"{tmp}/peak-{r}.json").read_text()) for r in (0, 1)]
        rise = max(p["peak"] - p["start"] for p in peaks)
        found[name] = {
            "step_s": statistics.median(steps),
            "peak_rss_rise_mib": rise / 2**20,
            "peak_rss_mib": max(p["peak"] for p in peaks) / 2**20,
            "wall_s": wall,
        }
        print(f"block_size {block} {name}: {found[name]}", flush=True)
    base = found["cp=1 (fsdp=2)"]
    for figures in found.values():
        figures["step_ratio"] = figures["step_s"] / base["step_s"]
        figures["memory_ratio"] = figures["peak_rss_rise_mib"] / base["peak_rss_rise_mib"]
    return found


def worst_bytes(overrides: list[str]) -> float | None:
    """The worst rank's bytes by `fw check` (None: refused, e.g. a length cp cannot split)."""
    from framework.errors import ConfigError
    from framework.preflight.check import check

    try:
        return float(check(overrides, quick=True).worst.total)
    except ConfigError as err:
        print(f"  refused: {str(err)[:300]}", flush=True)
        return None


def longest(fits, start: int, step: int, limit: int) -> int:
    """The longest length (a multiple of `step`, from `start` up to `limit`) for which `fits`
    holds: doubling, then halving the gap; 0 when even `start` does not fit."""
    if not fits(start):
        return 0
    good, bad = start, None
    while bad is None:
        if good * 2 > limit:
            return good
        if fits(good * 2):
            good *= 2
        else:
            bad = good * 2
    while bad - good > step:
        middle = (good + bad) // 2 // step * step
        if fits(middle):
            good = middle
        else:
            bad = middle
    return good


def fit_section(budget: float) -> dict[str, dict]:
    """The longest block_size each layout of `LAYOUTS` fits in `budget` bytes per process."""
    found = {}
    rows = 2  # sequences per data rank in every layout: a cp rank holds half of each
    for name, layout, _ in LAYOUTS:
        seen: dict[int, float | None] = {}

        def fits(block: int, layout=layout, seen=seen) -> bool:
            args = [*GPT, f"task.model.block_size={block}", f"task.data.batch_size={rows}"]
            args += ["trainer.devices=2", f"task.data.max_bytes={4 * rows * (block + 1)}"]
            args += ["task.data.val_fraction=0.5", *layout]
            seen[block] = worst_bytes(args)
            return seen[block] is not None and seen[block] <= budget

        best = longest(fits, 1024, 256, 1 << 20)
        found[name] = {"longest_block_size": best, "checked_gib": {
            str(k): None if v is None else round(v / GIB, 3) for k, v in sorted(seen.items())
        }}  # fmt: skip
        print(f"budget {budget / GIB:.2f} GiB {name}: {best}", flush=True)
    base = found["cp=1 (fsdp=2)"]["longest_block_size"]
    for figures in found.values():
        figures["ratio"] = figures["longest_block_size"] / base if base else None
    return found


def llama_section(cps=(1, 2, 4, 8)) -> dict[str, dict]:
    """The longest sequence per H100 for a Llama-3-8B shape over 8 ranks at each cp."""
    from framework.perf import parse_memory

    device = HEADROOM * parse_memory("--gpu-mem", H100)
    config = ",".join(f"{k}:{v}" for k, v in LLAMA_8B.items())
    found = {}
    for cp in cps:
        seen: dict[int, float | None] = {}

        def fits(seq: int, cp=cp, seen=seen) -> bool:
            args = [
                "task=hf_lm",
                "task.model.arch=llama",
                f"task.model.config={{{config}}}",
                f"task.data.block_size={seq}",
                "task.data.batch_size=1",
                f"task.data.max_bytes={11 * (seq + 1)}",  # 8 training sequences, 1 held out
                "task.data.val_fraction=0.1",
                "trainer.precision=bf16-mixed",
                "trainer.activation_checkpointing=full",
                "trainer.devices=8",
                "strategy=fsdp",
                *([f"strategy.cp={cp}"] if cp > 1 else []),
            ]
            started = time.perf_counter()
            seen[seq] = worst_bytes(args)
            took = time.perf_counter() - started
            shown = "refused" if seen[seq] is None else f"{seen[seq] / GIB:.1f} GiB"
            print(f"  llama-3-8b cp={cp} seq {seq}: {shown} ({took:.0f} s)", flush=True)
            return seen[seq] is not None and seen[seq] <= device

        best = longest(fits, 8192, 8192 * cp, 1 << 20)
        found[f"cp={cp}"] = {"longest_sequence": best, "checked_gib": {
            str(k): None if v is None else round(v / GIB, 2) for k, v in sorted(seen.items())
        }}  # fmt: skip
        print(f"llama-3-8b cp={cp}: {best} tokens per sequence", flush=True)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--section", default="all", choices=["steps", "fit", "llama", "all"])
    parser.add_argument("--budget", default="1GiB", help="per-process memory of the fit section")
    parser.add_argument("--blocks", default="1024,2048", help="block sizes of the steps section")
    args = parser.parse_args()
    from framework.perf import parse_memory

    load = load_average()
    results: dict = {}
    path = Path(__file__).parent / "results" / "context.json"
    if path.exists():  # a section run alone keeps the others' last figures
        old = json.loads(path.read_text())
        results = {k: v for k, v in old.items() if k in ("steps", "fit", "llama")}
    if args.section in ("steps", "all"):
        results["steps"] = {b: run_steps(int(b)) for b in args.blocks.split(",")}
    if args.section in ("fit", "all"):
        budget = parse_memory("--budget", args.budget)
        results["fit"] = {"budget_gib": budget / GIB, "layouts": fit_section(budget)}
    if args.section in ("llama", "all"):
        results["llama"] = {"device": H100, "usable": HEADROOM, "ranks": 8, **llama_section()}
    save_results("context", results, load)


if __name__ == "__main__":
    main()
