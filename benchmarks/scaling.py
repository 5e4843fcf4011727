"""Weak scaling on this machine: the step time of ddp, zero2 and fsdp with 1 and 2 CPU processes.

Every run is `fw train` of one compute-bound GPT (4 layers of width 256, 4 heads, sequences of
256 bytes, Ψ ≈ 3.29 M parameters) with the same batch per process (8 sequences), each process
with one intra-op thread (OMP_NUM_THREADS=1, which fw respects), so 2 processes do twice the work
of 1 on twice the cores. A step takes about 0.6 s on one core, against about 13 MB of fp32
gradients to exchange. The `StepTimer` callback records each step's start and end on rank 0; a
run's figure is the median step after the warm-up steps. The runs alternate (ddp 1, ddp 2, zero2
1, zero2 2, fsdp 1, fsdp 2, then again), and a case's figure is the median over the repeats.

Weak-scaling efficiency = step time with 1 process / step time with 2 processes, for each
strategy against itself at 1 process (ddp there is Lightning's single-device strategy: no
wrapper, no collective), and against ddp at 1 process. Goal for ddp: ≥ 0.90.

Communication: once per repeat, two processes (torch.multiprocessing, gloo) time an all_reduce
of the model's gradient bytes (fp32, Ψ elements); bytes / median time is the measured gloo
bandwidth. The step-time difference (2 processes - 1 process) is set against the time that
traffic needs at that bandwidth with no overlap: ddp all-reduces the gradients once (1x), zero2
reduce-scatters the gradients and all-gathers the parameters (the same bytes, 1x), fsdp gathers
the parameters in forward and again in backward and reduce-scatters the gradients (1.5x).

`--smoke`: a tiny GPT and a few steps, to check that the script runs; saves nothing.

Run from the repository root on a quiet machine: `python -m benchmarks.scaling` (about 10 min).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from benchmarks.common import (
    load_average,
    run_checked,
    save_results,
    step_durations,
    step_timer_args,
    train_command,
)

STRATEGIES = ("ddp", "zero2", "fsdp")
PROCESSES = (1, 2)
THREADS = 1
TARGET_DDP = 0.90
# Bytes each strategy moves per rank and step, in units of one all-reduce of the gradients.
VOLUME = {"ddp": 1.0, "zero2": 1.0, "fsdp": 1.5}
BYTES_PER_ELEMENT = 4  # fp32 gradients


@dataclass(frozen=True)
class Spec:
    """The model and batch, how long each run trains, how often everything is repeated."""

    n_layer: int
    n_embd: int
    n_head: int
    block_size: int
    batch_size: int
    steps: int
    warmup: int
    repeats: int
    allreduce_iters: int
    strategies: tuple[str, ...] = field(default=STRATEGIES)

    def overrides(self) -> list[str]:
        return [
            "task=gpt",
            f"task.model.n_layer={self.n_layer}",
            f"task.model.n_embd={self.n_embd}",
            f"task.model.n_head={self.n_head}",
            f"task.model.block_size={self.block_size}",
            "task.model.sample_length=0",  # no sampled text at the end
            f"task.data.batch_size={self.batch_size}",
            "task.data.max_bytes=600000",
        ]


FULL = Spec(4, 256, 4, 256, 8, steps=30, warmup=5, repeats=3, allreduce_iters=20)
SMOKE = Spec(2, 64, 2, 32, 4, steps=4, warmup=1, repeats=1, allreduce_iters=3)


def environment() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": str(THREADS), "WANDB_MODE": "disabled"}
    env.setdefault("DS_ACCELERATOR", "cpu")
    return env


def parameters(spec: Spec) -> int:
    """Ψ: the model's parameters (the tied head counted once)."""
    import torch

    from recipes.gpt.model import GPT

    with torch.device("meta"):
        model = GPT(256, spec.block_size, spec.n_layer, spec.n_head, spec.n_embd)
    return sum(p.numel() for p in model.parameters())


def step_time(spec: Spec, strategy: str, processes: int) -> float:
    """Rank 0's median step (seconds) after the warm-up, in one `fw train` run."""
    with tempfile.TemporaryDirectory(prefix="fw-bench-scaling-") as tmp:
        command = train_command(
            f"{tmp}/run",
            spec.steps,
            processes,
            *spec.overrides(),
            f"strategy={strategy}",
            *step_timer_args(tmp),
        )
        run_checked(command, f"{strategy} with {processes} processes", env=environment())
        return statistics.median(step_durations(tmp)[spec.warmup :])


def _allreduce_worker(rank: int, port: int, numel: int, iters: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(THREADS)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    grads = torch.zeros(numel)
    for _ in range(3):  # warm-up: connections, buffers
        dist.all_reduce(grads)
    times = []
    for _ in range(iters):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(grads)
        times.append(time.perf_counter() - start)
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    dist.barrier()
    dist.destroy_process_group()


def allreduce_time(numel: int, iters: int) -> float:
    """Median seconds of a gloo all_reduce of `numel` fp32 elements between 2 processes."""
    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="fw-bench-allreduce-") as tmp:
        out = Path(tmp) / "times.json"
        mp.start_processes(
            _allreduce_worker,
            args=(port, numel, iters, str(out)),
            nprocs=2,
            start_method="spawn",
        )
        return statistics.median(json.loads(out.read_text()))


def summarise(spec: Spec, psi: int, times: dict, allreduce: list[float]) -> dict:
    grad_bytes = psi * BYTES_PER_ELEMENT
    allreduce_s = statistics.median(allreduce)
    ddp_one = statistics.median(times[("ddp", 1)]) if ("ddp", 1) in times else None
    rows = []
    for strategy in spec.strategies:
        one, two = (statistics.median(times[(strategy, n)]) for n in PROCESSES)
        rows.append(
            {
                "strategy": strategy,
                "step_s_1_process": one,
                "step_s_2_processes": two,
                "efficiency": one / two,
                "efficiency_vs_ddp_1_process": ddp_one / two if ddp_one else None,
                "step_difference_s": two - one,
                "communication_volume_allreduces": VOLUME[strategy],
                "communication_s_at_gloo_bandwidth": VOLUME[strategy] * allreduce_s,
                "step_s_per_run": {str(n): times[(strategy, n)] for n in PROCESSES},
            }
        )
    return {
        "parameters": psi,
        "gradient_bytes": grad_bytes,
        "allreduce_s": allreduce_s,
        "allreduce_s_per_repeat": allreduce,
        "gloo_bandwidth_bytes_per_s": grad_bytes / allreduce_s,
        "rows": rows,
    }


def print_table(spec: Spec, summary: dict) -> None:
    mb = summary["gradient_bytes"] / 1e6
    print(
        f"\nGPT of {summary['parameters'] / 1e6:.2f} M parameters ({mb:.1f} MB of fp32 "
        f"gradients), batch {spec.batch_size} x {spec.block_size} tokens per process, "
        f"{THREADS} intra-op thread per process; median step after {spec.warmup} of "
        f"{spec.steps}, median of {spec.repeats} runs"
    )
    print(
        f"{'strategy':9}{'1 proc ms':>11}{'2 procs ms':>12}{'efficiency':>12}{'vs ddp 1':>10}"
        f"{'2 - 1 ms':>10}{'comm ms at gloo bw':>20}"
    )
    for row in summary["rows"]:
        vs_ddp = row["efficiency_vs_ddp_1_process"]
        print(
            f"{row['strategy']:9}{1e3 * row['step_s_1_process']:>11.1f}"
            f"{1e3 * row['step_s_2_processes']:>12.1f}{row['efficiency']:>12.3f}"
            f"{'n/a' if vs_ddp is None else f'{vs_ddp:.3f}':>10}"
            f"{1e3 * row['step_difference_s']:>10.1f}"
            f"{1e3 * row['communication_s_at_gloo_bandwidth']:>20.1f}"
        )
    print(
        f"gloo all_reduce of {mb:.1f} MB between 2 processes: "
        f"{1e3 * summary['allreduce_s']:.1f} ms (median) -> "
        f"{summary['gloo_bandwidth_bytes_per_s'] / 1e9:.2f} GB/s"
    )
    ddp = next((r for r in summary["rows"] if r["strategy"] == "ddp"), None)
    if ddp:
        met = "met" if ddp["efficiency"] >= TARGET_DDP else "NOT met"
        print(f"goal ddp efficiency >= {TARGET_DDP}: {ddp['efficiency']:.3f} -> {met}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny model, few steps, no save")
    parser.add_argument(
        "--strategies", default=",".join(STRATEGIES), help="comma-separated, of ddp,zero2,fsdp"
    )
    parser.add_argument("--repeats", type=int, default=None, help="default: 3 (smoke: 1)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    spec = SMOKE if args.smoke else FULL
    chosen = tuple(s for s in args.strategies.split(",") if s)
    unknown = set(chosen) - set(STRATEGIES)
    if unknown:
        raise SystemExit(f"--strategies: unknown {sorted(unknown)}; choose from {STRATEGIES}")
    spec = Spec(**{**asdict(spec), "strategies": chosen, "repeats": args.repeats or spec.repeats})
    load_at_start = load_average()
    if load_at_start > 0.5 and not args.smoke:
        print(f"warning: load average {load_at_start} at start: other work skews these figures")
    psi = parameters(spec)
    times: dict[tuple[str, int], list[float]] = {(s, n): [] for s in chosen for n in PROCESSES}
    allreduce: list[float] = []
    for repeat in range(spec.repeats):
        allreduce.append(allreduce_time(psi, spec.allreduce_iters))
        print(
            f"run {repeat + 1}/{spec.repeats}: all_reduce {1e3 * allreduce[-1]:.1f} ms", flush=True
        )
        for strategy in chosen:
            for n in PROCESSES:
                times[(strategy, n)].append(step_time(spec, strategy, n))
                print(
                    f"run {repeat + 1}/{spec.repeats}: {strategy} x {n}: "
                    f"{1e3 * times[(strategy, n)][-1]:.1f} ms",
                    flush=True,
                )
    summary = summarise(spec, psi, times, allreduce)
    print_table(spec, summary)
    if not args.smoke:
        results = {"spec": asdict(spec), "threads": THREADS, "target_ddp": TARGET_DDP, **summary}
        save_results("scaling", results, load_at_start)


if __name__ == "__main__":
    main()
