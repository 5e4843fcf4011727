"""`fw calibrate [--out FILE] [--processes N]`: measure this machine into a file `fw plan
--hardware FILE` reads (framework/preflight/hardware.py's Device, marked as a calibration).

N processes (2 by default) are started with torch's launcher (`torch.distributed.run`, as
torchrun), on the backend `fw train` would use here (gloo on the CPU), each with the threads a
worker of an N-process job gets (framework/worker.py: the cores shared out). Measured at the same
time in every process, as the job's ranks compete for the cores: matmul FLOP/s by dtype, the
memory bandwidth of a large copy, the host cost of one small operation, fused attention's
FLOP/s by dtype (forward and backward; on this CPU it runs well below the matmuls'); then the
all-reduce time by message size (each call after a layer's worth of compute where the
processes have a core each, `allreduce_times`), from which the latency (the small messages) and
the bus bandwidth (the largest: 2 (N-1)/N x bytes / time, the volume a ring moves per rank) are
taken; then the host's cost of an operation on DTensors and of one FSDP2 unit's hooks per step,
from a small model's step run plain, tensor parallel and under FSDP2 (`host_costs`). Each
figure but the all-reduce's is the median of its repeats (`typical_time`; the rates over
windows of about 0.1 s, `time_per_call`), as a measured step is the median of its windows.
The figures are the rates a step meets on this machine, so the efficiency is 1. Communication
and compute share the CPU's cores, so no traffic is taken to hide behind compute (overlap 0).
"""

from __future__ import annotations

import itertools
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from framework.errors import ConfigError

MATMUL = 512  # square matmuls of this size: a small transformer's per-rank shapes
SIZES = [2**k for k in range(10, 25, 2)]  # all-reduce bytes: 1 KiB .. 16 MiB
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
ATTENTION = (4, 4, 256, 32)  # batch, heads, sequence, head width: the attention probe's q, k, v
GAP_S = 0.003  # matmuls before each timed all-reduce: a layer's compute between collectives


def calibrate_command(args: list[str]) -> int:
    from framework.preflight.options import take_option

    out, args = take_option(args, "--out")
    processes, args = take_option(args, "--processes")
    if args:
        raise ConfigError(
            "option", args[0], "unknown option of fw calibrate", ["--out", "--processes"]
        )
    n = processes or "2"
    if not n.isdigit() or int(n) < 2:
        raise ConfigError("--processes", n, "needs at least 2 processes to measure collectives")
    target = Path(out or "calibration.json").resolve()
    if not target.parent.is_dir():
        raise ConfigError("--out", out, "its directory does not exist")
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
        "-m", "framework.preflight.calibrate", str(target),
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    done = subprocess.run(command, env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"fw calibrate: the measuring processes failed ({done.returncode})")
    sys.stdout.write(f"Wrote {target}\n")
    return 0


def times_of(run, repeats: int = 5) -> list[float]:
    run()  # warm-up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return times


def typical_time(run, repeats: int = 5) -> float:
    """The median time of `run` after a warm-up. A measured step is the median of its windows
    (framework/preflight/measure.py), so its parts are priced at their median too, not at the
    fastest of the repeats: between processes sharing cores a collective waits for its peer
    to be scheduled, and the luckiest repeat hides that (both are kept for the all-reduce)."""
    return statistics.median(times_of(run, repeats))


def time_per_call(call, window_s: float = 0.1, repeats: int = 7) -> float:
    """Seconds per `call`, the median of `repeats` windows of about `window_s` each (as many
    calls as fill one, from a timed first call): a window spans many scheduling slices, not
    the one or two of a few milliseconds' work."""
    started = time.perf_counter()
    call()
    calls = max(1, round(window_s / max(time.perf_counter() - started, 1e-9)))
    return typical_time(lambda: [call() for _ in range(calls)], repeats) / calls


def compute_rates(torch, together) -> dict:
    """Matmul TFLOP/s by dtype, a large copy's GB/s and a small operation's seconds, each
    started in every process at once (`together`: a barrier), as a job's ranks compete."""
    rates = {}
    for name, dtype in DTYPES.items():
        a = torch.randn(MATMUL, MATMUL, dtype=getattr(torch, dtype))
        b = torch.randn(MATMUL, MATMUL, dtype=getattr(torch, dtype))
        together()
        seconds = time_per_call(lambda a=a, b=b: a @ b)
        rates[name] = 2 * MATMUL**3 / seconds / 1e12
    big = torch.ones(2**24)  # 64 MiB: past the caches
    copy = torch.empty_like(big)
    together()
    seconds = time_per_call(lambda: copy.copy_(big))
    small = torch.ones(8)
    together()
    ops = time_per_call(lambda: small.add(1))
    attention = {name: attention_rate(torch, dtype, together) for name, dtype in DTYPES.items()}
    return {
        "tflops": rates,
        "attention_tflops": attention,
        "copy_gb_per_s": 2 * big.numel() * 4 / seconds / 1e9,
        "op_s": ops,
    }


def attention_rate(torch, dtype: str, together) -> float:
    """TFLOP/s of causal fused attention, forward and backward (ATTENTION's shape), its FLOPs
    counted as `fw plan` counts a step's (framework.preflight.replica.counting_mode)."""
    from framework.preflight.replica import counting_mode

    torch.manual_seed(0)
    q, k, v = (
        torch.randn(*ATTENTION, dtype=getattr(torch, dtype), requires_grad=True) for _ in range(3)
    )

    def run():
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.sum().backward()
        q.grad = k.grad = v.grad = None

    counter = counting_mode()
    with counter:
        run()
    together()
    return counter.attention_flops / time_per_call(run) / 1e12


def probe_model(torch):
    """Two small MLP blocks: the host's work dominates their step (the host-cost probes)."""
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32),
        nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32),
    )  # fmt: skip


def probe_step(torch, model):
    """Forward, backward and an AdamW step of `model` on one small batch."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(8, 32)

    def run():
        model(x).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    return run


def host_costs(torch, n: int, latency_s: float) -> dict[str, float]:
    """The host's cost per call of what a layout adds (framework/preflight/perf.py's host
    term), from the step of a small model measured three ways and counted with the counter `fw
    plan` counts with: plain; tensor parallel (column- then row-wise linears): (its time - the
    plain one's) per operation on DTensors; FSDP2 (each linear a unit, and the root): (its time
    - the plain one's - its DTensor operations at that cost) per unit, the unit's hooks and
    copies in and out. The parallel probes run on a one-process mesh in every process at once
    (sharing the cores as a job does), so they time the host's work alone; over the N
    processes' mesh, taking their collectives off at the median latency (about 2 ms here)
    left FSDP2's unit below zero. Collectives a probe still issues are taken off at the
    latency. A collective the communication term does not list costs the latency."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from framework.preflight.counting import fsdp_units, host_counting

    # every process's own one-process mesh (the second dimension), made by all of them together
    mesh = init_device_mesh("cpu", (n, 1), mesh_dim_names=("job", "alone"))["alone"]
    plan = {"0": ColwiseParallel(), "2": RowwiseParallel(), "3": ColwiseParallel(),
            "5": RowwiseParallel()}  # fmt: skip
    tensor = parallelize_module(probe_model(torch), mesh, plan)
    sharded = probe_model(torch)
    for k in plan:
        fully_shard(sharded[int(k)], mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    found = {}
    for name, model in {"plain": probe_model(torch), "tensor": tensor, "fsdp": sharded}.items():
        run = probe_step(torch, model)
        counter = host_counting()
        with counter:
            run()
        found[name] = (typical_time(lambda run=run: [run() for _ in range(10)]) / 10, counter)
    plain_s = found["plain"][0]
    seconds, counts = found["tensor"]
    extra = seconds - plain_s - counts.collectives * latency_s
    dtensor_op = max(0.0, extra / max(1, counts.dtensor_ops))
    seconds, counts = found["fsdp"]
    extra = seconds - plain_s - counts.dtensor_ops * dtensor_op - counts.collectives * latency_s
    unit = max(0.0, extra / fsdp_units(sharded))
    step = max(0.0, trainer_step_s(torch) - plain_s)
    return {"dtensor_op": dtensor_op, "collective": latency_s, "fsdp_unit": unit, "step": step}


def trainer_step_s(torch, steps: int = 60) -> float:
    """The median time between two training steps of the probe under a Lightning Trainer in
    this process (one device, fw's profiler, no logger, callback or checkpoint): the plain
    step's work plus the loop's own (fetching the batch, hooks, closure, optimizer wrapper)."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from framework.callbacks._hooks import QuietProfiler

    class Probe(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = probe_model(torch)

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).sum()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    class Clock(pl.Callback):
        def __init__(self) -> None:
            self.starts: list[float] = []

        def on_train_batch_start(self, *args) -> None:
            self.starts.append(time.perf_counter())

    clock = Clock()
    data = DataLoader(TensorDataset(torch.randn(8 * steps, 32)), batch_size=8)
    import logging
    import warnings

    lightning_log = logging.getLogger("lightning.pytorch")
    level = lightning_log.level
    lightning_log.setLevel(logging.WARNING)  # its device lines: not the calibration's output
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = pl.Trainer(
            accelerator="cpu", devices=1, strategy=pl.strategies.SingleDeviceStrategy("cpu"),
            max_steps=steps, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, profiler=QuietProfiler(),
            callbacks=[clock],
        )  # fmt: skip
        trainer.fit(Probe(), data)
    lightning_log.setLevel(level)
    gaps = [b - a for a, b in itertools.pairwise(clock.starts[steps // 4 :])]  # warmed up
    return statistics.median(gaps)


def allreduce_times(torch, dist) -> tuple[dict[int, float], dict[int, float]]:
    """The typical and the fastest time of one all-reduce, by message bytes.

    Where every process has a core, each call follows `GAP_S` of matmuls in every process, as a
    step's collectives come between its layers' compute: timed back to back they run warm,
    while after compute a rank often waits for its peer to be scheduled again, its core idle
    (here a 512 KiB all-reduce's median went from 1.0 to 2.0 ms). The waits' tail is long (a
    tenth of them 3-6 ms) and a step adds up many, so their mean is the typical time: 24 calls.

    Where the processes outnumber the cores, a rank that waits gives its core to another rank's
    compute, which the compute rates (measured in all processes at once) already count: the
    step pays a collective's own cost, the fastest of 9 runs of 4 calls back to back. (At 4
    processes on 2 cores a call after compute waited 10 ms, the median run's 4-7 ms, the
    fastest run's about 4.5; with the median the plan overestimated the layouts with many
    collectives by 30-60%, with the fastest the 8 measured ones are within 0.77-1.20.)"""
    shared = dist.get_world_size() > (os.cpu_count() or 1)  # the same in every process
    a = torch.randn(MATMUL // 2, MATMUL // 2)
    if not shared:
        started = time.perf_counter()
        a @ a
        rounds = torch.tensor(max(1, round(GAP_S / max(time.perf_counter() - started, 1e-6))))
        dist.broadcast(rounds, 0)  # the same work in every process: a skew of its own waits
    typical, fastest = {}, {}
    for size in SIZES:
        x = torch.ones(size // 4)
        dist.all_reduce(x)  # warm-up
        dist.barrier()
        if shared:

            def run(x=x):
                for _ in range(4):
                    dist.all_reduce(x)

            times = [t / 4 for t in times_of(run, repeats=9)]
            typical[size] = min(times)
        else:
            times = []
            for _ in range(24):
                for _ in range(int(rounds)):
                    a @ a
                started = time.perf_counter()
                dist.all_reduce(x)
                times.append(time.perf_counter() - started)
            typical[size] = statistics.mean(times)
        fastest[size] = min(times)
    return typical, fastest


def measure(out: str) -> None:
    """One measuring process (started by torch's launcher); rank 0 writes `out`."""
    import torch
    import torch.distributed as dist

    from framework.preflight.hardware import Device, Link, write_calibration

    n = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // n))  # as framework/worker.py
    dist.init_process_group("gloo")
    dist.barrier()
    local = compute_rates(torch, dist.barrier)
    times, fastest = allreduce_times(torch, dist)
    # a few KiB: latency only (the median of those sizes' typical times)
    latency = statistics.median(t for size, t in times.items() if size <= 2**14)
    local["host"] = host_costs(torch, n, latency)
    gathered = [None] * n
    dist.all_gather_object(gathered, local)
    if dist.get_rank() == 0:
        slowest = {k: min(g["tflops"][k] for g in gathered) for k in DTYPES}
        attention = {k: min(g["attention_tflops"][k] for g in gathered) for k in DTYPES}
        copy = min(g["copy_gb_per_s"] for g in gathered)
        op = max(g["op_s"] for g in gathered)
        host = {k: max(g["host"][k] for g in gathered) for k in gathered[0]["host"]}
        largest = max(times)
        bus = 2 * (n - 1) / n * largest / times[largest] / 1e9
        link = Link("gloo over loopback", bus, host["collective"])  # the slowest rank's
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
        device = Device(
            name=f"this machine ({n} processes, {torch.get_num_threads()} threads each)",
            tflops=slowest,
            memory_gib=round(memory, 1),
            hbm_gb_per_s=copy,
            efficiency=1.0,
            intra=link,
            inter=link,
            gpus_per_node=4096,  # one machine: every process on it
            op_overhead_s=op,
            overlap=0.0,
            accelerator="cpu",
            host=host,
            attention_tflops=attention,
            measured={
                "processes": n,
                "threads": torch.get_num_threads(),
                "matmul_size": MATMUL,
                "allreduce_s_by_bytes": {str(k): v for k, v in times.items()},
                "allreduce_fastest_s_by_bytes": {str(k): v for k, v in fastest.items()},
                "per_process": gathered,
                "load_average": os.getloadavg()[0],
            },
        )
        write_calibration(device, Path(out))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    import faulthandler

    faulthandler.enable()  # a fatal signal prints where each thread was
    measure(sys.argv[1])
    # Everything is written and the group left together. The interpreter's teardown would then
    # free the probes' meshes and process groups, whose gloo threads can still hold tensors: a
    # thread taking the GIL during finalization is unwound and aborts the process (SIGABRT,
    # "terminate called without an active exception"), failing a calibration that succeeded.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
