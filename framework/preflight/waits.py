"""The collective probes `fw calibrate` (framework/preflight/calibrate.py) runs in every process
at once over the job's group: an all-reduce's time by message size after a layer's compute, a
c10d all-reduce's wait after a short and a long stretch of compute, and what a functional
collective adds to a tensor-parallel step. A blocking collective here costs mostly the wait for
its peer, so each is timed as a step meets it, not back to back (unless the processes outnumber
the cores)."""

from __future__ import annotations

import os
import statistics
import time

from framework.preflight.hardware import CALIBRATED_GAP_S, STEP_PROBE_BYTES
from framework.preflight.rates import MATMUL, times_of, typical_time

SIZES = [2**k for k in range(10, 25, 2)]  # all-reduce bytes: 1 KiB .. 16 MiB
# compute between two blocking collectives (seconds) -> calls timed: a tensor-parallel layer's
# and a whole forward's
WAIT_GAPS_S = {0.002: 120, 0.02: 40}
# the tensor-parallel step probe's widths: about 2.5 and 5 ms of compute per collective here
STEP_WIDTHS = (64, 256)


def allreduce_times(torch, dist) -> tuple[dict[int, float], dict[int, float]]:
    """The typical and the fastest time of one all-reduce, by message bytes.

    Where every process has a core, each call follows `CALIBRATED_GAP_S` of matmuls in every
    process, as a step's collectives come between its layers' compute: timed back to back they
    run warm, while after compute a rank often waits for its peer to be scheduled again, its
    core idle (here a 512 KiB all-reduce's median went from 1.0 to 2.0 ms). The waits' tail is
    long (a tenth of them 3-6 ms, the fastest 0.2-0.4 ms up to 1 MiB) and a step adds up many,
    so their mean is the typical time: of 48 calls up to 1 MiB (24 gave means 2x apart from one
    calibration to the next), 24 above.

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
        took = max(time.perf_counter() - started, 1e-6)
        rounds = torch.tensor(max(1, round(CALIBRATED_GAP_S / took)))
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
            for _ in range(48 if size <= 2**20 else 24):
                for _ in range(int(rounds)):
                    a @ a
                started = time.perf_counter()
                dist.all_reduce(x)
                times.append(time.perf_counter() - started)
            typical[size] = statistics.mean(times)
        fastest[size] = min(times)
    return typical, fastest


def waits_after_compute(torch, dist) -> dict[str, dict[str, float]]:
    """The mean time of a blocking 1 KiB all-reduce through c10d (dist.all_reduce: DDP's
    buckets, FSDP2's and a pipeline's collectives, the logged values) after `WAIT_GAPS_S` of
    matmuls in every process, keyed `c10d`, then by the gap in seconds. The longer a rank
    computes alone, the further its peer drifts and the longer the wait (here about 1.3 ms
    after 2 ms, 2.2 ms after 20 ms). Empty where the processes outnumber the cores: a waiting
    rank's core then runs another's compute (`allreduce_times`)."""
    if dist.get_world_size() > (os.cpu_count() or 1):
        return {}
    a = torch.randn(MATMUL // 2, MATMUL // 2)
    x = torch.ones(256)
    started = time.perf_counter()
    for _ in range(10):
        a @ a
    each = torch.tensor((time.perf_counter() - started) / 10)
    dist.broadcast(each, 0)  # the same work in every process
    dist.all_reduce(x)  # warm-up
    found = {}
    for gap, calls in WAIT_GAPS_S.items():
        rounds = max(1, round(gap / max(float(each), 1e-6)))
        dist.barrier()
        times = []
        for _ in range(calls):
            for _ in range(rounds):
                a @ a
            started = time.perf_counter()
            dist.all_reduce(x)
            times.append(time.perf_counter() - started)
        found[str(gap)] = statistics.mean(times)
    return {"c10d": found}


def functional_waits(torch, dist) -> dict[str, float]:
    """Seconds one blocking functional collective (DTensor's, under tensor, expert and context
    parallelism) adds to a step, keyed by the step's compute per collective (seconds, as text):
    two transformer blocks (framework.nn) split over every process as `strategy.tp` splits them,
    at each of `STEP_WIDTHS` with as many tokens as make each all-reduce `STEP_PROBE_BYTES`,
    stepped (forward, backward, AdamW) over the job's group and over torch's `fake` group, whose
    collectives return at once: (real - fake) / functional collectives, at fake /
    functional collectives. Both times are the mean over the processes, so every process keys
    the same gap. Inside a step a collective costs more than after a loop of matmuls (here 2.3-2.9
    ms against 1.3-1.8 at the same compute): one rank's result comes back 1-4 ms after its
    peer's, its gloo threads woken late, and those threads' work takes the cores from the
    compute. Empty where the processes outnumber the cores (`allreduce_times`)."""
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.testing._internal.distributed import fake_pg  # noqa: F401 - the "fake" backend

    from framework.nn import TransformerBlock
    from framework.parallel.tensor import apply_tensor_parallel
    from framework.preflight.counting import host_counting

    n = dist.get_world_size()
    if n > (os.cpu_count() or 1):
        return {}
    # two meshes over the same ranks must differ by name: DTensor takes equal meshes for one
    meshes = {
        "real": init_device_mesh("cpu", (n,), mesh_dim_names=("probe_real",)),
        "fake": DeviceMesh.from_group(
            dist.new_group(backend="fake"), "cpu", mesh_dim_names=("probe_fake",)
        ),
    }
    found = {}
    for width in STEP_WIDTHS:
        rows = max(1, STEP_PROBE_BYTES // 4 // width // 128)
        seconds, calls = [], 0
        for mesh in meshes.values():
            torch.manual_seed(0)
            model = nn.Sequential(TransformerBlock(width, 4), TransformerBlock(width, 4))
            apply_tensor_parallel(model, mesh)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
            x = torch.randn(rows, 128, width)

            def run(model=model, optimizer=optimizer, x=x):
                model(x).sum().backward()
                optimizer.step()
                optimizer.zero_grad()

            counter = host_counting()
            with counter:
                run()
            calls = max(1, counter.counts()["functional"])
            dist.barrier()
            seconds.append(typical_time(lambda run=run: [run() for _ in range(5)], 7) / 5)
        mean = torch.tensor(seconds, dtype=torch.float64)
        dist.all_reduce(mean)
        real, fake = (mean / n).tolist()
        found[str(round(fake / calls, 6))] = max(0.0, (real - fake) / calls)
    return found
