"""Preflight: `fw check` (one job's memory per rank and the failures its workers would meet,
for any number of processes, in this one process) and `fw plan` (the layouts that fit)."""

from __future__ import annotations

from framework.errors import ConfigError


def take_option(args: list[str], name: str) -> tuple[str | None, list[str]]:
    """The value of `--name VALUE` or `--name=VALUE` in `args`, and the other words."""
    value, rest, words = None, [], iter(args)
    for word in words:
        if word == name:
            value = next(words, None)
            if value is None:
                raise ConfigError(name, None, "needs a value")
        elif word.startswith(name + "="):
            value = word.partition("=")[2]
        else:
            rest.append(word)
    return value, rest


def check_command(args: list[str], parse) -> int:
    """`fw check [--gpu-mem SIZE] [--ranks R,R] OVERRIDES`: prints the per-rank table; exit 2
    when a rank would fail or not fit."""
    import sys

    from framework.preflight.check import check

    gpu_mem, args = take_option(args, "--gpu-mem")
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
    report = check(overrides, dirs, gpu_mem, chosen)
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
    """`fw plan --gpus N [--gpu-mem SIZE|GPU] OVERRIDES`: the layouts that fit, best first."""
    import sys

    from framework.preflight.plan import plan, table

    gpus, args = take_option(args, "--gpus")
    gpu_mem, args = take_option(args, "--gpu-mem")
    if gpus is None or not gpus.isdigit():
        raise ConfigError("--gpus", gpus, "needs the number of GPUs, e.g. --gpus 8")
    if gpu_mem is None:
        raise ConfigError("--gpu-mem", None, "needs the memory of one GPU, e.g. 80GB or H100")
    from framework.perf import parse_memory

    parse_memory("--gpu-mem", gpu_mem)  # else every layout is left out for it: "nothing fits"
    multirun, dirs, overrides, _ = parse(args)
    if multirun:
        raise ConfigError("-m", "multirun", "fw plan plans one job; give one value per key")
    from framework.config.compose import compose_config

    compose_config(overrides, dirs)  # a misspelled key is named here, not left out of each layout
    options, refused = plan(overrides, int(gpus), gpu_mem, dirs)
    sys.stdout.write(table(options, refused, overrides, int(gpus)) + "\n")
    if not options:
        raise ConfigError(
            "--gpu-mem",
            gpu_mem,
            f"no layout of the job over {gpus} GPUs passes fw check and fits (reasons above)",
            hint="Add GPUs, lower the per-rank batch, or turn on trainer.activation_checkpointing.",
        )
    return 0
