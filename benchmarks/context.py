"""Context parallel side by side (issue 28): step time, memory and the longest sequence.

Four sections (`--section steps|agree|fit|llama|all`, default all):

- steps: a small gpt (`task=gpt`, 2 layers of width 128, 4 heads) at block_size 1024 and 2048
  on 2 CPU processes, the same global batch of 4 sequences per step: cp=1 (strategy=fsdp, each
  rank its own 2 sequences) against cp=2 with each cp_mode (both ranks the same 4 sequences,
  each half of every one). Per layout: the median step time of steps 3..8 (rank 0's StepTimer)
  and each rank's peak RSS rise over its RSS at the start of training (the PeakMemory callback
  below), with both as ratios to cp=1; beside the rise, what `fw check` says the worst rank adds
  once training starts (gradients, optimizer state, the larger of activations and the optimizer
  step's temporaries: `checked_rise_mib`, `rise_over_checked`).
- agree: cp=1 and ring at block_size 2048 again, with glibc told to return freed blocks above
  64 KiB (`MALLOC_MMAP_THRESHOLD_`), so that a rank's peak RSS rise is its tensors' peak and
  can be compared with fw check's (the default allocator's retained pages double it).
- fit: the longest block_size each layout fits in a fixed per-process budget (`--budget`,
  default 1 GiB), 2 sequences per data rank in every layout (a cp=2 rank holds half of each),
  by `fw check` on the fake backend (the worst rank's params + grads + optimizer +
  activations): doubling from 1024, then halving the gap to a step of 256.
- llama: the longest sequence one H100 (80 GiB, 90% usable as `fw plan` counts it) holds for a
  Llama-3-8B shape (transformers LlamaConfig: 32 layers, hidden 4096, MLP 14336, 32 heads, 8
  key/value heads, vocabulary 128256) over 8 ranks: strategy=fsdp (parameters, gradients and
  optimizer states sharded over the 8), cp = 1, 2, 4, 8 (ring), bf16-mixed, full activation
  checkpointing, one sequence per data rank; `fw check` of the whole model on the fake backend
  (under 0.5 GiB of this process's memory each): two lengths give the line the worst rank's
  activations follow, the length that fills the device follows from it, and a third check at
  that length says whether it fits (`llama_section`; `--cps 1,8` for some degrees).

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
HEADROOM = 0.9  # of the device's memory, as fw plan counts it (framework/preflight/planner.py)


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
    """Each layout's step time and peak RSS rise at `block` positions per sequence, and beside
    the rise what `fw check` says a rank adds once training starts (`checked_rise`)."""
    found = {name: run_layout(layout, rows, block) for name, layout, rows in LAYOUTS}
    for name, figures in found.items():
        print(f"block_size {block} {name}: {figures}", flush=True)
    base = found["cp=1 (fsdp=2)"]
    for figures in found.values():
        figures["step_ratio"] = figures["step_s"] / base["step_s"]
        figures["memory_ratio"] = figures["peak_rss_rise_mib"] / base["peak_rss_rise_mib"]
        figures["checked_ratio"] = figures["checked_rise_mib"] / base["checked_rise_mib"]
    return found


def run_layout(layout: list[str], rows: int, block: int, env: dict | None = None) -> dict:
    """One layout's `fw train` (2 processes, STEPS steps, in `env`): step time, peak RSS rise
    of the worst rank, and fw check's figures for the same overrides."""
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
        run_checked(command, f"{layout} at block_size {block}", env)
        wall = time.perf_counter() - started
        steps = step_durations(tmp)[SKIP:]
        peaks = [json.loads(Path(f"{tmp}/peak-{r}.json").read_text()) for r in (0, 1)]
    rise = max(p["peak"] - p["start"] for p in peaks)
    checked = checked_rise([a for a in command[2:] if not a.startswith("run.dir=")])
    return {
        "step_s": statistics.median(steps),
        "peak_rss_rise_mib": rise / 2**20,
        "peak_rss_mib": max(p["peak"] for p in peaks) / 2**20,
        "wall_s": wall,
        **{f"checked_{k}_mib": v / 2**20 for k, v in checked.items()},
        "rise_over_checked": rise / checked["rise"],
    }


def agree_section(block: int = 2048) -> dict[str, dict]:
    """fw check against a real run: cp=1 and ring at `block`, as in the steps section, but with
    glibc returning every freed block above 64 KiB to the system (MALLOC_MMAP_THRESHOLD_):
    its default keeps freed activations and the next step's land on new pages, so the peak RSS
    of 8 steps is about twice one step's tensors whatever the model (measured: 1.85x-2.33x),
    a property of the allocator, not of the tensors fw check counts."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    found = {}
    for name, layout, rows in LAYOUTS[:2]:
        found[name] = run_layout(layout, rows, block, env)
        print(f"agree block_size {block} {name}: {found[name]}", flush=True)
    return found


def checked_rise(overrides: list[str]) -> dict[str, float]:
    """What `fw check` says the worst rank of the run adds to its memory once training starts
    (the parameters exist before): gradients, optimizer state and the larger of the
    activations and the optimizer step's temporaries (`rise`), and those terms apart."""
    from framework.preflight.check import check

    rank = max(check(overrides).ranks, key=lambda r: r.total - r.params)
    return {
        "rise": float(rank.total - rank.params),
        "activations": float(rank.activations),
        "grads_optimizer": float(rank.grads + rank.optimizer),
    }


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


def llama_rank(layers: int, seq: int, cp: int):
    """`fw check`'s worst rank of the Llama-3-8B shape cut to `layers` layers, one sequence of
    `seq` positions per data rank, 8 ranks (fsdp over all 8, cp of them sharing a sequence)."""
    from framework.preflight.check import check

    shape = {**LLAMA_8B, "num_hidden_layers": layers}
    config = ",".join(f"{k}:{v}" for k, v in shape.items())
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
    rank = check(args, quick=True).worst
    took = time.perf_counter() - started
    print(f"  {layers} layers cp={cp} seq {seq}: {rank.activations / GIB:.2f} GiB of "
          f"activations ({took:.0f} s)", flush=True)  # fmt: skip
    return rank


def llama_section(cps=(1, 2, 4, 8), per_rank=(8192, 16384)) -> dict[str, dict]:
    """The longest sequence per H100 for the Llama-3-8B shape over 8 ranks at each cp.

    Forward and backward's peak is affine in the sequence once it is long (each layer's saved
    input under full checkpointing, the logits and the loss grow with it; FSDP's gathered
    parameters do not; attention adds nothing quadratic: torch's fused CPU kernel and the
    context-parallel attention over it keep only their outputs and log-sum-exp per position, as
    flash attention does on a GPU). Two checks of the whole model, at `per_rank` positions per
    cp rank, give that line; the length where the worst rank's total reaches 90% of the device
    follows (rounded down to a multiple of 2 x cp x 128), and a third check at that length says
    whether it fits. Each check runs in under 0.5 GiB of this process's memory (about 2 minutes
    on 2 cores)."""
    from framework.perf import parse_memory

    device = HEADROOM * parse_memory("--gpu-mem", H100)
    found = {}
    base = None
    for cp in cps:
        s1, s2 = (t * cp for t in per_rank)
        one, two = llama_rank(32, s1, cp), llama_rank(32, s2, cp)
        slope = (two.activations - one.activations) / (s2 - s1)
        const = one.activations - s1 * slope
        step = 2 * cp * 128
        best = int((device - one.model_states - const) / slope) // step * step
        there = llama_rank(32, best, cp)
        found[f"cp={cp}"] = {
            "longest_sequence": best,
            "fits": there.total <= device,
            "checked_gib": {str(s1): one.total / GIB, str(s2): two.total / GIB,
                            str(best): there.total / GIB},
            "line_gib_at_longest": (one.model_states + const + best * slope) / GIB,
            "activations_kib_per_position": slope / 2**10,
            "model_states_gib": one.model_states / GIB,
        }  # fmt: skip
        base = base or (best if cp == 1 else None)
        found[f"cp={cp}"]["ratio"] = best / base if base else None
        print(f"llama-3-8b cp={cp}: {best} tokens per sequence ({found[f'cp={cp}']})", flush=True)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sections = ["steps", "agree", "fit", "llama", "all"]
    parser.add_argument("--section", default="all", choices=sections)
    parser.add_argument("--budget", default="1GiB", help="per-process memory of the fit section")
    parser.add_argument("--blocks", default="1024,2048", help="block sizes of the steps section")
    parser.add_argument("--cps", default="1,2,4,8", help="cp degrees of the llama section")
    args = parser.parse_args()
    from framework.perf import parse_memory

    load = load_average()
    results: dict = {}
    path = Path(__file__).parent / "results" / "context.json"
    if path.exists():  # a section run alone keeps the others' last figures
        old = json.loads(path.read_text())
        results = {k: v for k, v in old.items() if k in [*sections, "load_average_by_section"]}
    if args.section in ("steps", "all"):
        steps = results.setdefault("steps", {})  # block sizes not run keep their figures
        steps.update({b: run_steps(int(b)) for b in args.blocks.split(",")})
    if args.section in ("agree", "all"):
        results["agree"] = agree_section()
    if args.section in ("fit", "all"):
        budget = parse_memory("--budget", args.budget)
        results["fit"] = {"budget_gib": budget / GIB, "layouts": fit_section(budget)}
    if args.section in ("llama", "all"):
        cps = tuple(int(c) for c in args.cps.split(","))
        llama = results.setdefault("llama", {})  # degrees not run keep their figures
        llama.update({"device": H100, "usable": HEADROOM, "ranks": 8, **llama_section(cps)})
    save_results("context", results, load)


if __name__ == "__main__":
    main()
