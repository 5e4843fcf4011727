"""Expert parallel on CPU: step time of moe_gpt at ep = 1, 2 (and 4 on 4 processes) relative to
ep = 1 on the same processes; all-to-all rows per rank per step against the formula for a
balanced routing; grouped GEMM against the per-expert loop; and the load of the experts over
training with and without the bias update (a plot).

The model: moe_gpt with 2 layers, width 128, 8 experts of hidden 256, top-2, sequences of 128
bytes, 8 sequences per data rank per step, fp32. `StepTimer` gives rank 0's median step over
steps 10-30. With round-robin routing (`task.model.routing=round_robin`: token t to experts t,
t+1 mod E, balanced by construction) each rank sends T k (ep-1)/ep token rows per layer to the
other ranks when dispatching; the combine sends as many back, and backward repeats both, so the
elements a rank moves per layer and step are 4 T k D (ep-1)/ep (T its tokens, D the width); the
measured figure is `rows_sent` (from the split sizes handed to the all-to-all) x 4 D.
Run: `python -m benchmarks.moe` (part of `make bench`).
"""

from __future__ import annotations

import csv
import statistics
import tempfile
from pathlib import Path

from benchmarks.common import (
    ROOT,
    load_average,
    run_checked,
    save_results,
    step_durations,
    step_timer_args,
    train_command,
)

LAYERS, WIDTH, HEADS, SEQ, EXPERTS, TOP_K, BATCH = 2, 128, 4, 128, 8, 2, 8
MODEL = [
    "task=moe_gpt",
    f"task.model.n_layer={LAYERS}",
    f"task.model.n_embd={WIDTH}",
    f"task.model.n_head={HEADS}",
    f"task.model.block_size={SEQ}",
    f"task.model.num_experts={EXPERTS}",
    f"task.model.top_k={TOP_K}",
    "task.model.expert_hidden=256",
    "task.model.sample_length=0",
    "task.data.max_bytes=400000",
    f"task.data.batch_size={BATCH}",
    "task.scheduler.name=constant",
]
STEPS, WARMUP = 30, 10
# name, processes, strategy args
CASES = [
    ("ep=1 x2", 2, ["strategy=fsdp"]),
    ("ep=2 x2", 2, ["strategy=expert"]),
    ("ep=1 x4", 4, ["strategy=fsdp"]),
    ("ep=2 x4", 4, ["strategy=fsdp", "strategy.ep=2"]),
    ("ep=4 x4", 4, ["strategy=expert"]),
]


def rows(run_dir: str) -> list[dict[str, str]]:
    with (Path(run_dir) / "metrics.csv").open(newline="") as fh:
        return list(csv.DictReader(fh))


def run(args: list[str], processes: int, steps: int = STEPS) -> tuple[float, list[dict]]:
    """(rank 0's median step in seconds over steps WARMUP..steps, the metrics rows)."""
    with tempfile.TemporaryDirectory(prefix="fw-bench-moe-") as tmp:
        command = train_command(
            f"{tmp}/run", steps, processes, *MODEL, *args, *step_timer_args(tmp)
        )
        command = [c for c in command if c != "callbacks=none"] + [
            "callbacks=none",
            "+callbacks.moe.kind=moe",
            "trainer.log_every_n_steps=1",
        ]
        run_checked(command, args)
        durations = step_durations(tmp)[WARMUP:] or step_durations(tmp)
        return statistics.median(durations), rows(f"{tmp}/run")


def load_curve(metrics: list[dict]) -> list[float]:
    """max_load of layer 0 at every step (1.0: every expert got the same tokens)."""
    return [float(r["moe/layer0/max_load"]) for r in metrics if r.get("moe/layer0/max_load")]


def plot(curves: dict[str, list[float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2))
    for name, values in curves.items():
        ax.plot(range(len(values)), values, label=name)
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle=":")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("busiest expert / mean (layer 0)")
    ax.set_title(f"moe_gpt, {EXPERTS} experts, top-{TOP_K}: expert load")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    load_at_start = load_average()
    step, traffic = {}, {}
    for name, processes, args in CASES:
        step[name], _ = run(args, processes)
        _, balanced = run([*args, "task.model.routing=round_robin"], processes, steps=3)
        sent = float(
            next(r["moe/layer0/rows_sent"] for r in balanced if r.get("moe/layer0/rows_sent"))
        )
        ep = int(name.split("=")[1].split()[0])
        tokens = BATCH * SEQ
        formula = 4 * tokens * TOP_K * WIDTH * (ep - 1) / ep
        traffic[name] = {"elements": sent * 4 * WIDTH, "formula": formula}
        print(
            f"{name}: median step {step[name] * 1000:.1f} ms, a2a elements {sent * 4 * WIDTH:.0f} vs {formula:.0f}"
        )
    relative = {name: step[name] / step[f"ep=1 x{processes}"] for name, processes, _ in CASES}
    gemm = {}
    for variant in ("grouped", "loop"):
        gemm[variant], _ = run(["strategy=ddp", f"task.model.gemm={variant}"], 1)
    curves = {}
    for label, rate in (
        ("bias update 1e-2", "1e-2"),
        ("bias update 1e-3", "1e-3"),
        ("no bias update", "0"),
    ):
        _, metrics = run(["strategy=ddp", f"task.model.bias_update_rate={rate}"], 1, steps=200)
        curves[label] = load_curve(metrics)
    image = ROOT / "docs" / "img" / "moe_load.png"
    plot(curves, image)
    print()
    print(f"{'layout':<10}{'step (ms)':>11}{'vs ep=1':>9}{'a2a ratio':>11}")
    for name, _, _ in CASES:
        t = traffic[name]
        ratio = t["elements"] / t["formula"] if t["formula"] else float("nan")
        print(f"{name:<10}{step[name] * 1000:>11.1f}{relative[name]:>9.3f}{ratio:>11.4f}")
    print(
        f"grouped GEMM vs loop, 1 process: {gemm['grouped'] * 1000:.1f} vs {gemm['loop'] * 1000:.1f} ms ({gemm['grouped'] / gemm['loop']:.3f})"
    )
    print(
        "max load at steps 0/50/100/199: "
        + "; ".join(
            f"{k}: " + ", ".join(f"{v[i]:.2f}" for i in (0, 50, 100, -1)) for k, v in curves.items()
        )
    )
    save_results(
        "moe",
        {
            "model": {
                "layers": LAYERS,
                "width": WIDTH,
                "experts": EXPERTS,
                "top_k": TOP_K,
                "seq": SEQ,
                "batch_per_data_rank": BATCH,
            },
            "median_step_s": step,
            "step_vs_ep1": relative,
            "all_to_all_elements_per_rank_per_layer_step": traffic,
            "gemm_step_s": gemm,
            "max_load_layer0": curves,
        },
        load_at_start,
    )


if __name__ == "__main__":
    main()
