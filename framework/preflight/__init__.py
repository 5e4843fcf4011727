"""Preflight: `fw check` (one job's memory per rank and the failures its workers would meet,
for any number of processes, in this one process) and `fw plan` (the layouts that fit)."""

from __future__ import annotations

from framework.errors import ConfigError
from framework.preflight.options import take_option


def check_command(args: list[str], parse) -> int:
    """`fw check [--gpu-mem SIZE] [--host-mem SIZE] [--ranks R,R] OVERRIDES`: prints the per-rank
    table; exit 2 when a rank would fail or not fit, or a node's loads would not fit its host."""
    import sys

    from framework.preflight.check import check

    gpu_mem, args = take_option(args, "--gpu-mem")
    host_mem, args = take_option(args, "--host-mem")
    ranks, args = take_option(args, "--ranks")
    chosen = None
    if ranks is not None:
        try:
            chosen = [int(r) for r in ranks.split(",")]
        except ValueError:
            raise ConfigError("--ranks", ranks, "is not a comma-separated list of ranks") from None
    multirun, dirs, overrides, _ = parse(args)
    if multirun:
        raise ConfigError("-m", "multirun", "fw check checks one job; give one value per key")
    report = check(overrides, dirs, gpu_mem, chosen, host_mem=host_mem)
    sys.stdout.write(report.table() + "\n")
    if report.fits is False:
        worst = report.worst
        raise ConfigError(
            "--gpu-mem",
            gpu_mem,
            f"rank {worst.rank} needs about {worst.total / 2**30:.1f} GiB per step, more than "
            "the device holds",
            hint="Shard more (strategy=fsdp, zero3, a higher tp or pp), lower the per-rank batch, "
            "or turn on trainer.activation_checkpointing; `fw plan` lists layouts that fit.",
        )
    return 0


__all__ = ["check_command", "plan_command", "take_option"]


def plan_command(args: list[str], parse) -> int:
    """`fw plan --gpus N [--gpu NAME | --hardware FILE | --gpu-mem SIZE] [--tokens T]
    [--price-per-gpu-hour P] [--sort time|cost|simplicity] [--json] [--measure K] OVERRIDES`."""
    from framework.preflight.planner import plan_command as run

    return run(args, parse)
