"""`fw calibrate [--out FILE] [--processes N] [--cpu]`: measure this machine into a file `fw plan
--hardware FILE` reads (framework/preflight/hardware.py's Device, marked as a calibration).

It measures the CPU: on a machine with CUDA devices it refuses (a GPU job is planned from the GPU
tables, `fw plan --gpu NAME`) unless `--cpu` asks for the CPU anyway.

N processes (2 by default) are started as launcher=local starts a job's workers (a store on
127.0.0.1, signed with a token of this run; `python -P`), on the backend `fw train` would use here
(gloo on the CPU), each with the threads and the allocator settings a worker of an N-process job
gets (framework/worker.py: the cores shared out; framework/allocator.py: freed memory kept for the
next step). Measured at the same time in every process, as the job's ranks compete for the cores:
the compute rates (framework/preflight/rates.py); the all-reduce time by message size after a
layer's worth of compute (framework/preflight/waits.py's `allreduce_times`), from which the latency
(the small messages) and the bus bandwidth (the largest: 2 (N-1)/N x bytes / time, the volume a
ring moves per rank) are taken; the wait of a blocking collective after a short and a long stretch
of compute (`waits_after_compute`); what one blocking functional collective adds to a tensor-
parallel step (`functional_waits`); the host's cost of an operation on DTensors and of one FSDP2
unit's hooks per step, from a small model's step run plain, tensor parallel and under FSDP2
(`host_costs`); and the training loop's own work per step (`trainer_step_s`). The figures are the
rates a step meets on this machine, so the efficiency is 1. Communication and compute share the
CPU's cores, so no traffic is taken to hide behind compute (overlap 0).
"""

from __future__ import annotations

import itertools
import os
import statistics
import sys
import time
from pathlib import Path

from framework.errors import ConfigError
from framework.preflight.rates import MATMUL, compute_rates, typical_time
from framework.preflight.waits import allreduce_times, functional_waits, waits_after_compute


def calibrate_command(args: list[str]) -> int:
    from framework.preflight.options import take_option

    out, args = take_option(args, "--out")
    processes, args = take_option(args, "--processes")
    cpu = "--cpu" in args
    args = [a for a in args if a != "--cpu"]
    if args:
        raise ConfigError(
            "option", args[0], "unknown option of fw calibrate", ["--out", "--processes", "--cpu"]
        )
    n = processes or "2"
    if not n.isdigit() or int(n) < 2:
        raise ConfigError("--processes", n, "needs at least 2 processes to measure collectives")
    target = Path(out or "calibration.json").resolve()
    if not target.parent.is_dir():
        raise ConfigError("--out", out, "its directory does not exist")
    if not cpu:
        refuse_cuda()
    failure = run_measuring_processes(int(n), target)
    if failure is not None:
        raise RuntimeError(f"fw calibrate: the measuring processes failed: {failure}")
    sys.stdout.write(f"Wrote {target}\n")
    return 0


def refuse_cuda() -> None:
    """ConfigError on a machine with CUDA devices: a calibration measures the CPU and gloo,
    so it would describe a GPU node's host, not its GPUs (a GPU job is planned from the GPU
    tables: fw plan --gpu NAME)."""
    import torch

    if torch.cuda.is_available():
        raise ConfigError(
            "fw calibrate",
            f"{torch.cuda.device_count()} CUDA device(s)",
            "measures this machine's CPU and gloo only, not its GPUs or NCCL: a GPU job is "
            "planned from the GPU tables",
            hint="Plan it with fw plan --gpu NAME (H100, A100, ...); add --cpu to calibrate "
            "this machine's CPU for CPU jobs anyway.",
        )


def run_measuring_processes(n: int, target: Path) -> str | None:
    """`n` measuring processes, started as launcher=local starts a job's workers on one machine
    (framework/launchers/local): fresh interpreters (`python -P`: the working directory's files
    shadow no module), a store on 127.0.0.1 whose values are signed with a token of this run
    (framework/stores.py). None when they finished, else what failed."""
    from framework.launchers import local
    from framework.processes import python
    from framework.world import World

    world = World(world_size=n, devices=n, num_nodes=1, accelerator="cpu")
    cfg = local.Config(start_method="spawn", hang_timeout_s=0)
    executable, *args = python("-m", "framework.preflight.calibrate", str(target))
    entry = (executable, tuple(args))
    threads = os.environ.pop("OMP_NUM_THREADS", None)  # measure() shares the cores out
    try:
        return local.start_workers(cfg, world, "spawn", entry, target.parent)
    finally:
        if threads is not None:
            os.environ["OMP_NUM_THREADS"] = threads


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


def host_costs(torch) -> dict[str, float]:
    """The host's cost per call of what a layout adds (framework/preflight/perf.py's host
    term), from the step of a small model measured three ways and counted with the counter `fw
    plan` counts with: plain; tensor parallel (column- then row-wise linears): (its time - the
    plain one's) per operation on DTensors; FSDP2 (each linear a unit, and the root): (its time
    - the plain one's - its DTensor operations at that cost) per unit, the unit's hooks and
    copies in and out. The parallel probes run on torch's `fake` process group of the job's
    size, each process its own rank, in every process at once (sharing the cores as a job
    does): their collectives are issued as over the real group (DTensor's redistributions,
    the functional collectives' wrapping) and return at once, so the probes time the host's
    work alone, the waits measured apart (`waits_after_compute`). On a mesh of one process
    DTensor skips its redistributions: 15 us an operation here against 21 us over two. A
    collective the communication term does not list costs the link's latency (`describe`
    adds it as `collective`)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )
    from torch.testing._internal.distributed import fake_pg  # noqa: F401 - the "fake" backend

    from framework.preflight.counting import fsdp_units, host_counting

    mesh = DeviceMesh.from_group(dist.new_group(backend="fake"), "cpu")  # made by all together
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
    dtensor_op = max(0.0, (seconds - plain_s) / max(1, counts.dtensor_ops))
    seconds, counts = found["fsdp"]
    extra = seconds - plain_s - counts.dtensor_ops * dtensor_op
    unit = max(0.0, extra / fsdp_units(sharded))
    step = max(0.0, trainer_step_s(torch) - plain_s)
    return {"dtensor_op": dtensor_op, "fsdp_unit": unit, "step": step}


def trainer_step_s(torch, steps: int = 60) -> float:
    """The median time between two training steps of the probe under a Lightning Trainer in
    this process (one device, fw's profiler, no logger, callback or checkpoint): the plain
    step's work plus the loop's own (fetching the batch, hooks, closure, optimizer wrapper)."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from framework.runtime.hooks import QuietProfiler

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


def measure(out: str) -> None:
    """One measuring process (started by torch's launcher); rank 0 writes `out`."""
    import torch
    import torch.distributed as dist

    from framework import allocator
    from framework.preflight.hardware import write_calibration
    from framework.stores import sign_worker_store

    n = int(os.environ["WORLD_SIZE"])
    allocator.configure(allocator.mode_for("auto", on_cuda=False))  # as a CPU job's workers
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // n))  # as framework/worker.py
    sign_worker_store()  # the process group's store, as a job's workers sign it
    dist.init_process_group("gloo")
    dist.barrier()
    local = compute_rates(torch, dist.barrier)
    times, fastest = allreduce_times(torch, dist)
    local["allreduce_s"], local["allreduce_fastest_s"] = times, fastest
    local["waits"] = waits_after_compute(torch, dist)
    functional = functional_waits(torch, dist)
    if functional:
        local["waits"]["functional"] = functional
    local["host"] = host_costs(torch)
    gathered = [None] * n
    dist.all_gather_object(gathered, local)
    if dist.get_rank() == 0:
        write_calibration(describe(gathered, torch.get_num_threads()), Path(out))
    dist.barrier()
    dist.destroy_process_group()


def latency_of(times: dict[int, float]) -> float:
    """One collective's fixed cost: the mean time of the messages of a few KiB (up to 16)."""
    return statistics.mean(t for size, t in times.items() if size <= 2**14)


def describe(gathered: list[dict], threads: int):
    """The Device the processes' figures (`gathered`, one dict each) describe: each rate the
    slowest process's (the job waits for it), each collective's time the mean over the
    processes (one waits while another arrives), each host cost the largest."""
    from framework.preflight.hardware import Device, Link

    n = len(gathered)

    def slowest(key: str) -> dict:
        return {k: min(g[key][k] for g in gathered) for k in gathered[0][key]}

    rates = slowest("tflops")
    # each size's share of the peak, the slowest process's rates both
    shares = {k: min(g["matmul_share"][k] * g["tflops"]["fp32"] for g in gathered)
              / rates["fp32"] for k in gathered[0]["matmul_share"]}  # fmt: skip
    mean = statistics.mean
    waits = {kind: {gap: mean(g["waits"][kind][gap] for g in gathered) for gap in by_gap}
             for kind, by_gap in gathered[0]["waits"].items()}  # fmt: skip
    times = {
        size: mean(g["allreduce_s"][size] for g in gathered) for size in gathered[0]["allreduce_s"]
    }
    fastest = {size: min(g["allreduce_fastest_s"][size] for g in gathered) for size in times}
    host = {k: max(g["host"][k] for g in gathered) for k in gathered[0]["host"]}
    host["collective"] = latency_of(times)
    largest = max(times)
    bus = 2 * (n - 1) / n * largest / times[largest] / 1e9
    link = Link(
        "gloo over loopback", bus, host["collective"], {str(k): v for k, v in times.items()}
    )
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return Device(
        name=f"this machine ({n} processes, {threads} threads each)",
        tflops=rates,
        memory_gib=round(memory, 1),
        hbm_gb_per_s=min(g["copy_gb_per_s"] for g in gathered),
        efficiency=1.0,
        intra=link,
        inter=link,
        gpus_per_node=4096,  # one machine: every process on it
        op_overhead_s=max(g["op_s"] for g in gathered),
        overlap=0.0,
        accelerator="cpu",
        host=host,
        attention_tflops=slowest("attention_tflops"),
        elementwise_gb_per_s=slowest("elementwise_gb_per_s"),
        matmul_share=shares,
        waits=waits,
        measured={
            "processes": n,
            "threads": threads,
            "matmul_size": MATMUL,
            "allreduce_fastest_s_by_bytes": {str(k): v for k, v in fastest.items()},
            "per_process": gathered,
            "load_average": os.getloadavg()[0],
        },
    )


if __name__ == "__main__":
    import faulthandler

    from framework.processes import die_with_parent

    die_with_parent()  # a killed fw calibrate leaves no measuring process behind
    faulthandler.enable()  # a fatal signal prints where each thread was
    measure(sys.argv[1])
    # Everything is written and the group left together. The interpreter's teardown would then
    # free the probes' meshes and process groups, whose gloo threads can still hold tensors: a
    # thread taking the GIL during finalization is unwound and aborts the process (SIGABRT,
    # "terminate called without an active exception"), failing a calibration that succeeded.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
