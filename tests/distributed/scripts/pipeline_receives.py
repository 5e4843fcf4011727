"""Run by torch's launcher with 3 processes (tests/distributed/test_plan_time.py): one training
step of torch's pipeline schedules, as `strategy=pipeline` builds them (SCHEDULES of
framework/parallel/pipeline/schedule.py), on a stack of small linear stages, counting the
receives each rank posts. Each CASES entry runs on the first pp ranks. Usage:
pipeline_receives.py OUT. Writes OUT/rank<R>.json: {case: the rank's receives in the step}."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import pipelining

from framework.parallel.pipeline.schedule import SCHEDULES

WIDTH, ROWS = 8, 8


def counted(stage, tally: list[int]):
    """Wrap the stage's receive builders: each non-empty list is one receive the rank waits on."""
    for name in ("get_fwd_recv_ops", "get_bwd_recv_ops"):
        build = getattr(stage, name)

        def wrapped(*args, _build=build, **kwargs):
            ops = _build(*args, **kwargs)
            tally[0] += 1 if ops else 0
            return ops

        setattr(stage, name, wrapped)
    return stage


CASES = {  # name: (pp, schedule, microbatches, virtual stages)
    "1f1b pp2": (2, "1f1b", 4, 1),
    "gpipe pp2": (2, "gpipe", 4, 1),
    "1f1b pp3": (3, "1f1b", 4, 1),
    "interleaved_1f1b pp2": (2, "interleaved_1f1b", 4, 2),
}


def step(pp: int, schedule: str, micro: int, virtual: int) -> int:
    """The receives this rank posts in one step of the schedule over ranks 0..pp-1."""
    group = dist.new_group(list(range(pp)))  # every rank takes part in creating it
    rank = dist.get_rank()
    if rank >= pp:
        return 0
    n_stages = pp * virtual
    tally = [0]
    stages = []
    for s in range(rank, n_stages, pp):  # stage s on rank s % pp, as the loop schedules place them
        torch.manual_seed(s)
        block = nn.Linear(WIDTH, WIDTH)
        stage = pipelining.PipelineStage(block, s, n_stages, torch.device("cpu"), group=group)
        stages.append(counted(stage, tally))
    cls = getattr(pipelining, SCHEDULES[schedule])
    single = virtual == 1
    runner = cls(
        stages[0] if single else stages,
        n_microbatches=micro,
        loss_fn=lambda y, t: nn.functional.mse_loss(y, t),
    )
    torch.manual_seed(100)
    x, target = torch.randn(ROWS, WIDTH), torch.randn(ROWS, WIDTH)
    last = rank == (n_stages - 1) % pp
    if rank == 0:
        runner.step(x, target=target if last else None)
    else:
        runner.step(target=target if last else None)
    return tally[0]


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    found = {name: step(*case) for name, case in CASES.items()}
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(found))
    dist.destroy_process_group()
    # Written and the group left. The interpreter's teardown would free the process groups
    # while gloo's threads may still hold them, which can abort the process ("terminate called
    # without an active exception", as framework/preflight/calibrate.py found): leave now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
