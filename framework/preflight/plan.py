"""`fw plan OVERRIDES --gpus N [--gpu-mem SIZE|GPU]`: every layout of the job over N GPUs that
`fw check` accepts, with its memory per rank and bytes sent per step, the recommended one first.

Each layout is checked exactly as `fw check` would (framework/preflight/check.py); one that fails
there is left out. With `strategy=NAME` among the overrides (a strategy of your own, say) only that
strategy is checked, with its own settings. The bytes are the standard per-rank volumes of one optimizer step (ring
collectives, the (N-1)/N factor left out): data parallel all-reduces the gradients (2Ψ, Ψ the
gradient bytes), ZeRO-1/2 reduce-scatter them and all-gather the updated parameters (2Ψ), ZeRO-3 and
FSDP gather the parameters again for backward (3Ψ), tensor parallel all-reduces activations twice
in forward and twice in backward per layer (4·b·s·h), a pipeline sends each microbatch's
activations forward and their gradients back at each stage boundary (2·b·s·h), and
mixture-of-experts layers all-to-all the routed tokens there and back, forward and backward
(4·b·s·k·h per layer). The data-parallel bytes and the degrees come from the strategy plugin
(`data_traffic`, `mesh_dims`: framework.plugins.StrategyCapabilities).

The layouts are listed, and the first recommended, in the order a practitioner tries them: whole
replicas first (ddp; zero1, zero2: the same bytes as ddp, less memory), then sharded parameters
(zero3, fsdp: 1.5 times the bytes), then tensor parallel within a node (activations all-reduced
every layer), then pipelines (a bubble of (p-1)/(m+p-1) of every step idle). Fewer bytes per rank
alone would favour pipelines for any model, bubble or not; the order says what each step costs in
idle or exposed time, which bytes do not.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig

from framework.errors import ConfigError
from framework.preflight.check import CheckReport, check
from framework.preflight.simulate import RankMemory

log = logging.getLogger("framework.preflight")
GPUS_PER_NODE = 8
HEADROOM = 0.9  # of the device's memory: allocator fragmentation and the CUDA context


@dataclass
class Option:
    """One layout that passed `fw check`."""

    order: int  # in the candidates' list: the simpler layouts first (see the docstring)
    name: str
    overrides: list[str]
    report: CheckReport
    comm_bytes: float

    @property
    def worst(self) -> RankMemory:
        return self.report.worst


def layouts(gpus: int, tp_limit: int) -> list[tuple[str, list[str]]]:
    """Candidate strategies and degrees for `gpus` processes (tensor parallel within a node)."""
    found = [(s, [f"strategy={s}"]) for s in ("ddp", "zero1", "zero2", "zero3", "fsdp")]
    small = [d for d in (2, 4, 8) if gpus % d == 0 and d <= gpus]
    for tp in (d for d in small if d <= tp_limit):
        found.append((f"fsdp x tp{tp}", ["strategy=fsdp_tp", f"strategy.tp={tp}"]))
    for pp in small:
        found.append(
            (f"pp{pp} x fsdp", ["strategy=pipeline", f"strategy.pp={pp}", "strategy.fsdp=-1"])
        )
        for tp in (d for d in small if d <= tp_limit and pp * d <= gpus and gpus % (pp * d) == 0):
            found.append(
                (
                    f"pp{pp} x fsdp x tp{tp}",
                    [
                        "strategy=pipeline",
                        f"strategy.pp={pp}",
                        "strategy.fsdp=-1",
                        f"strategy.tp={tp}",
                    ],
                )
            )
    return found


def world_overrides(gpus: int) -> list[str]:
    per_node = min(gpus, GPUS_PER_NODE)
    if gpus % per_node:
        raise ConfigError("--gpus", gpus, f"is not a multiple of {GPUS_PER_NODE} GPUs per node")
    return [
        "trainer.accelerator=gpu",
        f"trainer.devices={per_node}",
        f"trainer.num_nodes={gpus // per_node}",
    ]


def plan(
    overrides: list[str],
    gpus: int,
    gpu_mem: str,
    extra_dirs: list[Path] | None = None,
) -> tuple[list[Option], list[tuple[str, str]]]:
    """The layouts that pass `fw check` (best first) and the refused ones with their reason."""
    if gpus < 1:
        raise ConfigError("--gpus", gpus, "must be at least 1")
    keys = {o.split("=", 1)[0].lstrip("+~"): o.split("=", 1)[-1] for o in overrides}
    for key in ("trainer.devices", "trainer.num_nodes", "trainer.accelerator"):
        if key in keys:
            raise ConfigError(key, "given", "fw plan chooses it; leave it out of the overrides")
    world = world_overrides(gpus)
    candidates = layouts(gpus, min(gpus, GPUS_PER_NODE))
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
    return options, refused


def comm_bytes(cfg: DictConfig, report: CheckReport) -> float:
    """Bytes one rank sends per optimizer step under this layout (see the module docstring)."""
    from framework.plugins import capability

    plugin, strategy, world = report.plugin, report.strategy, report.world
    dims = capability(plugin, "mesh_dims")(strategy, world)
    degrees = {"pp": dims.pp, "tp": dims.tp} if dims is not None else {"pp": 1, "tp": 1}
    grads = max(r.grads for r in report.ranks)  # this rank's share of the gradients
    params = max(r.params for r in report.ranks)
    data = capability(plugin, "data_traffic")(strategy, world, grads, params)
    model = dict(cfg.task.model)
    rows, seq = int(cfg.task.data.get("batch_size", 0)), int(model.get("block_size", 0))
    width, n_layer = int(model.get("n_embd", 0)), int(model.get("n_layer", 0))
    act = rows * seq * width * (2 if "16" in str(cfg.trainer.precision) else 4)
    sent = data
    if degrees["tp"] > 1:
        sent += 4 * act * n_layer / degrees["pp"]
    if degrees["pp"] > 1:
        sent += 2 * act
    if "num_experts" in model:
        sent += 4 * act * int(model.get("top_k", 1)) * n_layer / degrees["pp"]
    return float(sent)


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
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    if not options:
        lines.append("  none fits")
    if refused:
        lines.append("Left out:")
        lines += [f"  {name}: {why}" for name, why in refused]
    return "\n".join(lines)
