"""Tensor parallel against ddp on one job: step time, parameter bytes per process, and the elements
the tensor-parallel collectives move per step against the Megatron formula.

The job: a GPT of 4 layers, width h = 256, 4 heads, sequences of s = 256 bytes, a global batch of 8
sequences per step, fp32 on CPU. Each layout trains it for 30 steps, one run at a time:

- ddp on 2 processes (4 sequences each) and on 4 (2 each);
- tensor parallel, tp = 2 (the 2 processes share each batch of 8), without and with sequence
  parallelism;
- fsdp_tp on 4 processes: FSDP2 over 2 data-parallel ranks x tp = 2 (4 sequences per pair).

`StepTimer` gives rank 0's median step over steps 10-30; `TPProbe` gives rank 0's parameter bytes
(local shards) and, at step 3, the collectives inside the transformer blocks. Megatron's count
for one layer and one step is 4 x b x s x h elements through all-reduces (2 forward, 2 backward,
b = the sequences a tensor-parallel group processes); with sequence parallelism the same
elements go through all-gathers and reduce-scatters (4 of each, each moving half as many bytes
per rank as an all-reduce). Run: `python -m benchmarks.tensor` (part of `make bench`).
"""

from __future__ import annotations

import json
import statistics
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

LAYERS, WIDTH, HEADS, SEQ, GLOBAL_BATCH = 4, 256, 4, 256, 8
MODEL = [
    "task=gpt",
    f"task.model.n_layer={LAYERS}",
    f"task.model.n_embd={WIDTH}",
    f"task.model.n_head={HEADS}",
    f"task.model.block_size={SEQ}",
    "task.model.sample_length=0",
    "task.data.max_bytes=400000",
]
# name, strategy args, processes, tensor-parallel degree, data-parallel degree
CASES = [
    ("ddp x2", ["strategy=ddp"], 2, 1, 2),
    ("tp=2", ["strategy=tensor"], 2, 2, 1),
    ("tp=2 + sp", ["strategy=tensor", "strategy.sequence_parallel=true"], 2, 2, 1),
    ("ddp x4", ["strategy=ddp"], 4, 1, 4),
    ("fsdp 2 x tp 2", ["strategy=fsdp_tp"], 4, 2, 2),
]
STEPS, WARMUP = 30, 10


def run(args: list[str], processes: int, dp: int) -> tuple[list[float], dict]:
    with tempfile.TemporaryDirectory(prefix="fw-bench-tensor-") as tmp:
        command = train_command(
            f"{tmp}/run",
            STEPS,
            processes,
            *MODEL,
            *args,
            f"task.data.batch_size={GLOBAL_BATCH // dp}",
            *step_timer_args(tmp),
            "+callbacks.probe._target_=benchmarks.tp_probe.TPProbe",
            f"+callbacks.probe.out={tmp}",
            f"+callbacks.probe.count={'strategy=ddp' not in args}",
        )
        run_checked(command, args)
        steps = step_durations(tmp)
        probe = json.loads((Path(tmp) / "tp-probe.json").read_text())
    return steps[WARMUP:], probe


def main() -> None:
    load_at_start = load_average()
    rows = []
    for name, args, processes, tp, dp in CASES:
        steps, probe = run(args, processes, dp)
        per_group = GLOBAL_BATCH // dp  # sequences one tensor-parallel group processes per step
        formula = 4 * per_group * SEQ * WIDTH * LAYERS if tp > 1 else 0
        moved = sum(v["elements"] for v in probe["block_collectives"].values())
        if "sequence_parallel=true" in " ".join(args):
            moved //= 2  # an all-gather or reduce-scatter moves half an all-reduce's bytes
        rows.append(
            {
                "layout": name,
                "processes": processes,
                "median_step_s": statistics.median(steps),
                "param_bytes_per_rank": probe["param_bytes_rank0"],
                "block_collectives": probe["block_collectives"],
                "allreduce_equivalent_elements": moved,
                "megatron_elements": formula,
                "ratio_to_formula": round(moved / formula, 4) if formula else None,
            }
        )
    base = {2: rows[0], 4: rows[3]}
    print(f"GPT {LAYERS} x {WIDTH}, s = {SEQ}, global batch {GLOBAL_BATCH}; CPU, fp32")
    print(
        "layout          N  step (ms)  vs ddp  param MiB/rank  vs ddp  TP elements/step  formula  ratio"
    )
    for r in rows:
        ref = base[r["processes"]]
        r["step_vs_ddp"] = round(r["median_step_s"] / ref["median_step_s"], 3)
        r["params_vs_ddp"] = round(r["param_bytes_per_rank"] / ref["param_bytes_per_rank"], 3)
        ratio = "" if r["ratio_to_formula"] is None else f"{r['ratio_to_formula']:.4f}"
        print(
            f"{r['layout']:<14} {r['processes']:>2} {r['median_step_s'] * 1e3:>10.1f} "
            f"{r['step_vs_ddp']:>7.3f} {r['param_bytes_per_rank'] / 2**20:>15.2f} "
            f"{r['params_vs_ddp']:>7.3f} {r['allreduce_equivalent_elements']:>17} "
            f"{r['megatron_elements']:>8} {ratio:>6}"
        )
    results = {"model": MODEL, "global_batch": GLOBAL_BATCH, "steps": STEPS, "rows": rows}
    save_results("tensor", results, load_at_start)


if __name__ == "__main__":
    main()
