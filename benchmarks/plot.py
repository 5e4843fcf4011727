"""Pictures of the benchmark results for the docs: `python -m benchmarks.plot`.

Reads `benchmarks/results/memory.json` and `benchmarks/results/strategies.json` and writes
`docs/img/memory.png` (per-rank model-state MiB of each strategy at 1, 2 and 4 processes, measured
bars against the ZeRO formula as a marker) and `docs/img/step_time.png` (step time relative to
ddp). Needs matplotlib (installed with the `bench` extra).
"""

from __future__ import annotations

import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from benchmarks.common import RESULTS, ROOT  # noqa: E402

OUT = ROOT / "docs" / "img"
MIB = 2**20
PARTS = ("params", "grads", "optimizer")
COLORS = {"params": "#4c72b0", "grads": "#dd8452", "optimizer": "#55a868"}


def plot_memory() -> None:
    rows = json.loads((RESULTS / "memory.json").read_text())["rows"]
    labels = [f"{r['strategy']}\nN={r['processes']}" for r in rows]
    fig, ax = plt.subplots(figsize=(11, 4.5))
    bottom = [0.0] * len(rows)
    for part in PARTS:
        heights = [r["measured_bytes"][part] / MIB for r in rows]
        ax.bar(labels, heights, bottom=bottom, color=COLORS[part], label=f"measured: {part}")
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    theory = [r["theory_bytes"]["total"] / MIB for r in rows]
    ax.scatter(labels, theory, marker="_", s=900, color="black", zorder=3, label="ZeRO formula")
    psi = rows[0]["psi"]
    ax.set_ylabel("MiB per process")
    ax.set_title(f"Model state per process, fp32 + Adam, Ψ = {psi / 1e6:.2f} M parameters (CPU)")
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(OUT / "memory.png", dpi=110)
    plt.close(fig)


def plot_step_time() -> None:
    record = json.loads((RESULTS / "strategies.json").read_text())
    rows = record["rows"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar([r["strategy"] for r in rows], [r["ratio_to_ddp"] for r in rows], color="#4c72b0")
    ax.axhline(1.0, color="black", linewidth=0.8)
    for i, r in enumerate(rows):
        ax.text(i, r["ratio_to_ddp"], f"{r['ratio_to_ddp']:.2f}", ha="center", va="bottom")
    ax.set_ylabel("step time / ddp")
    ax.set_title(f"Step time relative to ddp, {record['processes']} CPU processes")
    fig.tight_layout()
    fig.savefig(OUT / "step_time.png", dpi=110)
    plt.close(fig)


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    plot_memory()
    plot_step_time()
    print(f"wrote {OUT.relative_to(ROOT)}/memory.png and step_time.png")


if __name__ == "__main__":
    main()
