"""`fw plan OVERRIDES --gpus N [--gpu-mem SIZE|GPU]`: every layout of the job over N GPUs that
`fw check` accepts, with its memory per rank and bytes sent per step, the recommended one first.

Each layout is checked exactly as `fw check` would (framework/preflight/check.py); one that fails
there is left out. With `strategy=NAME` among the overrides (a strategy of your own, say) only that
strategy is checked, with its own settings. The bytes are the standard per-rank volumes of one
optimizer step, by the group that sends them (framework/preflight/traffic.py); with a device each
layout also carries its predicted step (framework/preflight/perf.py), tabled by
framework/preflight/timetable.py.

The layouts are listed, and the first recommended, in the order a practitioner tries them: whole
replicas first (ddp; zero1, zero2: the same bytes as ddp, less memory), then sharded parameters
(zero3, fsdp: 1.5 times the bytes), then tensor parallel within a node (activations all-reduced
every layer), then pipelines (a bubble of (p-1)/(m+p-1) of every step idle). Fewer bytes per rank
alone would favour pipelines for any model, bubble or not; the order says what each step costs in
idle or exposed time, which bytes do not.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from framework.errors import ConfigError
from framework.preflight.check import check
from framework.preflight.timetable import (
    SORTS,
    Option,
    aligned,
    predicted_rows,
    ranked,
    time_table,
)
from framework.preflight.traffic import comm_bytes, layout_facts

log = logging.getLogger("framework.preflight")
GPUS_PER_NODE = 8
HEADROOM = 0.9  # of the device's memory: allocator fragmentation and the CUDA context


def layouts(gpus: int, tp_limit: int) -> list[tuple[str, list[str]]]:
    """Candidate strategies and degrees for `gpus` processes (tensor parallel within a node),
    as each built-in strategy plugin proposes them (its `plan_candidates`)."""
    from framework.plugins import builtin_kinds, capability, load_plugin

    found = []
    for kind in builtin_kinds("strategy", ordered=True):
        plugin = load_plugin("strategy", kind, "strategy.kind")
        found += capability(plugin, "plan_candidates")(gpus, tp_limit)
    return found


def world_overrides(
    gpus: int, accelerator: str = "gpu", per_node: int = GPUS_PER_NODE
) -> list[str]:
    per_node = min(gpus, per_node)
    if gpus % per_node:
        raise ConfigError("--gpus", gpus, f"is not a multiple of {per_node} GPUs per node")
    return [
        f"trainer.accelerator={accelerator}",
        f"trainer.devices={per_node}",
        f"trainer.num_nodes={gpus // per_node}",
    ]


def plan(
    overrides: list[str],
    gpus: int,
    gpu_mem: str,
    extra_dirs: list[Path] | None = None,
    device: Any = None,
) -> tuple[list[Option], list[tuple[str, str]]]:
    """The layouts that pass `fw check` (simplest first) and the refused ones with their reason;
    with a `device` (framework.preflight.hardware.Device) each option carries its predicted
    step (framework/preflight/perf.py)."""
    if gpus < 1:
        raise ConfigError("--gpus", gpus, "must be at least 1")
    keys = {o.split("=", 1)[0].lstrip("+~"): o.split("=", 1)[-1] for o in overrides}
    for key in ("trainer.devices", "trainer.num_nodes", "trainer.accelerator"):
        if key in keys:
            raise ConfigError(key, "given", "fw plan chooses it; leave it out of the overrides")
    per_node = device.gpus_per_node if device is not None else GPUS_PER_NODE
    world = world_overrides(gpus, device.accelerator if device else "gpu", per_node)
    candidates = layouts(gpus, min(gpus, per_node))
    if "strategy" in keys:  # the one strategy named, e.g. one of the user's own
        candidates = [(keys["strategy"], [])]
    options, refused = [], []
    for order, (name, layout) in enumerate(candidates):
        args = [*overrides, *layout, *world]
        try:
            report = check(args, extra_dirs, gpu_mem, quick=True)
        except ConfigError as err:
            refused.append((name, str(err)))
            continue
        if report.worst.total > HEADROOM * (report.device_bytes or 0):
            refused.append(
                (name, f"needs {report.worst.total / 2**30:.1f} GiB on rank {report.worst.rank}")
            )
            continue
        options.append(Option(order, name, layout, report, comm_bytes(report.config, report)))
    options.sort(key=lambda o: o.order)  # the simplest layout that fits comes first
    if device is not None and options:
        predict_all(options, device, per_node)
    return options, refused


def predict_all(options: list[Option], device: Any, per_node: int) -> None:
    """Each option's predicted step on `device`; the replica's work is counted once (the
    layouts differ in strategy only, not in the per-rank batch or the model)."""
    from framework.preflight.check import first_batch
    from framework.preflight.perf import predict
    from framework.preflight.replica import count_replica

    first = options[0].report
    work = count_replica(first.config, first_batch(first.config, first.plan))
    for o in options:
        o.prediction = predict(work, layout_facts(o.report, per_node), device)


def table(options: list[Option], refused: list[tuple[str, str]], base: list[str], gpus: int) -> str:
    world = " ".join(world_overrides(gpus))
    lines = [f"Layouts of the job over {gpus} GPUs that pass fw check (best first):"]
    head = ("", "layout", "worst rank GiB", "sent GiB/step", "command")
    rows = [head]
    for i, o in enumerate(options):
        command = " ".join(["fw", "train", *base, *o.overrides, world])
        rows.append(
            (
                "*" if i == 0 else str(i + 1),
                o.name,
                f"{o.worst.total / 2**30:.2f}",
                f"{o.comm_bytes / 2**30:.3f}",
                command,
            )
        )
    return aligned(lines, rows, len(head), not options, refused)


def positive(key: str, text: str | None) -> float | None:
    """A number above zero from the command line (None when not given), else ConfigError."""
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(key, text, "is not a number") from None
    if not value > 0 or value == float("inf"):
        raise ConfigError(key, text, "must be a number above zero")
    return value


def plan_command(args: list[str], parse) -> int:
    """`fw plan`: the layouts that fit, and with a device (`--gpu`, `--hardware`) their
    predicted step time, throughput, MFU, hours for `--tokens` and cost."""
    import json
    import sys

    from framework.perf import parse_memory
    from framework.preflight.hardware import known_device, read_calibration
    from framework.preflight.options import take_option

    values = {}
    for name in ("--gpus", "--gpu-mem", "--gpu", "--hardware", "--tokens",
                 "--price-per-gpu-hour", "--sort", "--measure"):  # fmt: skip
        values[name], args = take_option(args, name)
    as_json = "--json" in args
    args = [a for a in args if a != "--json"]
    gpus, gpu_mem = values["--gpus"], values["--gpu-mem"]
    if gpus is None or not gpus.isdigit():
        raise ConfigError("--gpus", gpus, "needs the number of GPUs, e.g. --gpus 8")
    if values["--gpu"] and values["--hardware"]:
        raise ConfigError("--hardware", values["--hardware"], "give --gpu or --hardware, not both")
    device = None
    if values["--gpu"] is not None:
        device = known_device(values["--gpu"])
    elif values["--hardware"] is not None:
        device = read_calibration(values["--hardware"])
    tokens = positive("--tokens", values["--tokens"])
    price = positive("--price-per-gpu-hour", values["--price-per-gpu-hour"])
    sort = values["--sort"] or "time"
    if sort not in SORTS:
        raise ConfigError("--sort", sort, "is not a sort order", list(SORTS))
    measure = values["--measure"]
    if measure is not None and (not measure.isdigit() or int(measure) < 1):
        raise ConfigError("--measure", measure, "needs how many layouts to run, e.g. --measure 3")
    if device is None and (as_json or tokens or price or measure or values["--sort"]):
        raise ConfigError(
            "--gpu", None, "predictions need a device: --gpu NAME or --hardware FILE",
            hint="e.g. --gpu H100, or measure this machine with `fw calibrate --out FILE`.",
        )  # fmt: skip
    if measure is not None and device is not None and device.accelerator == "gpu":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(
                "--measure", measure, f"runs the layouts here, and this machine has no GPU "
                f"for --gpu {device.name}",
                hint="Measure this machine with `fw calibrate --out FILE`, then --hardware FILE.",
            )  # fmt: skip
    if gpu_mem is None and device is not None:
        gpu_mem = f"{device.memory_gib}GiB"
    if gpu_mem is None:
        raise ConfigError("--gpu-mem", None, "needs the memory of one GPU, e.g. 80GB or H100")
    parse_memory("--gpu-mem", gpu_mem)  # else every layout is left out for it: "nothing fits"
    multirun, dirs, overrides, _ = parse(args)
    if multirun:
        raise ConfigError("-m", "multirun", "fw plan plans one job; give one value per key")
    from framework.config.compose import compose_config

    composed = compose_config(overrides, dirs)  # a misspelled key is named here, not per layout
    float8 = composed.trainer.get("float8", "none") not in (None, "none")
    if float8 and device is not None and device.accelerator != "cpu" and "fp8" not in device.tflops:
        from framework.preflight.perf import no_float8

        raise no_float8(device)  # before every layout is checked for nothing
    options, refused = plan(overrides, int(gpus), gpu_mem, dirs, device)
    if device is None:
        sys.stdout.write(table(options, refused, overrides, int(gpus)) + "\n")
    else:
        rows = ranked(predicted_rows(options, overrides, int(gpus), tokens, price), sort)
        per_node = device.gpus_per_node
        world = " ".join(world_overrides(int(gpus), device.accelerator, per_node))
        if measure is not None:
            from framework.preflight.measure import measure_rows

            measure_rows(rows[: int(measure)], world.split(), dirs)
        if as_json:
            sys.stdout.write(json.dumps(rows, indent=2) + "\n")
        else:
            sys.stdout.write(time_table(rows, refused, device, int(gpus), world) + "\n")
            if float8 and device.accelerator != "cpu":
                sys.stdout.write(
                    f"The float8 layers' matmuls are predicted from the {device.name}'s stated "
                    "float8 peak (its datasheet), not measured.\n"
                )
            if measure is not None and rows:
                from framework.preflight.measure import comparison

                sys.stdout.write(comparison(rows) + "\n")
    if not options:
        raise ConfigError(
            "--gpu-mem",
            gpu_mem,
            f"no layout of the job over {gpus} GPUs passes fw check and fits (reasons above)",
            hint="Add GPUs, lower the per-rank batch, or turn on trainer.activation_checkpointing.",
        )
    return 0
