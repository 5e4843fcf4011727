"""Per-rank model-state memory of ddp, zero1, zero2, zero3 and fsdp, against the ZeRO formulas.

Each case is one `fw train` of a small GPT (`task=gpt`, 4 layers of width 256, about 3.26 M
parameters) on CPU for 3 steps, with the `MemoryProbe` callback (`benchmarks/memory_probe.py`)
added from the command line. At the second step the probe reads, on every rank, the bytes of
parameters, gradients and optimizer state that the process holds, from the tensors themselves.
The figures are compared with the formulas for fp32 training with Adam (Ψ parameters, N
processes, 4 bytes an element): params 4Ψ (4Ψ/N for zero3 and fsdp), gradients 4Ψ (4Ψ/N for
zero2, zero3 and fsdp), optimizer state 8Ψ (8Ψ/N for all but ddp); in all ddp 16Ψ, zero1
8Ψ + 8Ψ/N, zero2 4Ψ + 12Ψ/N, zero3 and fsdp 16Ψ/N. ZeRO-3 runs with
`strategy.param_persistence_threshold=0`, so that small tensors are sharded too.

Run from the repository root: `python -m benchmarks.memory` (or `make bench`).
"""

from __future__ import annotations

import json
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.common import FW, load_average, run_checked, save_results

MODEL = [
    "task=gpt",
    "task.model.n_layer=4",
    "task.model.n_embd=256",
    "task.model.n_head=4",
    "task.data.max_bytes=300000",
    "task.data.batch_size=4",
]
CASES = [("ddp", 1)] + [(s, n) for n in (2, 4) for s in ("ddp", "zero1", "zero2", "zero3", "fsdp")]
TOLERANCE = 0.05
PARTS = ("params", "grads", "optimizer")
# Which parts each strategy shards over the N processes.
SHARDED = {
    "ddp": (),
    "zero1": ("optimizer",),
    "zero2": ("grads", "optimizer"),
    "zero3": ("params", "grads", "optimizer"),
    "fsdp": ("params", "grads", "optimizer"),
}
BYTES_PER_PSI = {"params": 4, "grads": 4, "optimizer": 8}
MIB = 2**20


def theory(strategy: str, n: int, psi: int) -> dict[str, float]:
    parts = {p: BYTES_PER_PSI[p] * psi / (n if p in SHARDED[strategy] else 1) for p in PARTS}
    return {**parts, "total": sum(parts.values())}


def measure(strategy: str, n: int) -> list[dict]:
    """The probe's record of every rank for one run."""
    extra = ["strategy.param_persistence_threshold=0"] if strategy == "zero3" else []
    with tempfile.TemporaryDirectory(prefix="fw-bench-memory-") as tmp:
        args = [
            FW,
            "train",
            *MODEL,
            f"strategy={strategy}",
            *extra,
            f"trainer.devices={n}",
            "trainer.accelerator=cpu",
            "trainer.max_steps=3",
            "trainer.enable_progress_bar=false",
            "trainer.enable_model_summary=false",
            "callbacks=none",
            "logger=[csv]",
            "+callbacks.memory._target_=benchmarks.memory_probe.MemoryProbe",
            f"+callbacks.memory.out={tmp}",
            f"run.dir={tmp}/run",
        ]
        run_checked(args, f"{strategy} N={n}")
        return [json.loads((Path(tmp) / f"memory-rank{r}.json").read_text()) for r in range(n)]


def summarize(strategy: str, n: int, ranks: list[dict]) -> dict:
    """The largest rank's figures (ranks differ by padding only), theory and ratios."""
    psi = ranks[0]["psi"]
    measured = {p: max(r[p] for r in ranks) for p in PARTS}
    measured["total"] = max(sum(r[p] for p in PARTS) for r in ranks)
    expected = theory(strategy, n, psi)
    ratio = {k: round(measured[k] / expected[k], 4) for k in expected}
    sharded = SHARDED[strategy]
    meets = all(abs(ratio[p] - 1) <= TOLERANCE for p in sharded) if sharded else None
    return {
        "strategy": strategy,
        "processes": n,
        "psi": psi,
        "measured_bytes": measured,
        "theory_bytes": expected,
        "ratio": ratio,
        "sharded_parts": list(sharded),
        "sharded_parts_within_5_percent": meets,
        "master_copy_bytes": max(r["master"] for r in ranks),
        "grads_peak_in_backward_bytes": max(r["grads_peak_in_backward"] for r in ranks),
        "per_rank": ranks,
    }


def mib(x: float) -> str:
    return f"{x / MIB:.2f}"


def main() -> None:
    load_at_start = load_average()
    # Two runs at a time: at most 8 processes, each a few hundred MB.
    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = list(pool.map(lambda case: measure(*case), CASES))
    rows = [summarize(s, n, ranks) for (s, n), ranks in zip(CASES, runs, strict=True)]
    psi = rows[0]["psi"]
    print(f"Ψ = {psi} parameters; MiB per rank (largest rank), fp32 with Adam")
    header = (
        "strategy  N   params    grads  optimizer    total   theory  ratio  "
        "sharded within 5%  master copy  grads peak in backward"
    )
    print(header)
    for r in rows:
        m, t = r["measured_bytes"], r["theory_bytes"]
        meets = {None: "n/a", True: "yes", False: "no"}[r["sharded_parts_within_5_percent"]]
        print(
            f"{r['strategy']:<8} {r['processes']:>2} {mib(m['params']):>8} {mib(m['grads']):>8} "
            f"{mib(m['optimizer']):>10} {mib(m['total']):>8} {mib(t['total']):>8} "
            f"{r['ratio']['total']:>6.3f}  {meets:>17}  {mib(r['master_copy_bytes']):>11}  "
            f"{mib(r['grads_peak_in_backward_bytes']):>22}"
        )
    results = {"psi": psi, "tolerance": TOLERANCE, "model": MODEL, "rows": rows}
    save_results("memory", results, load_at_start)


if __name__ == "__main__":
    main()
