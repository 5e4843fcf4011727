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
(4·b·s·k·h per layer). Under context parallel (cp > 1) a rank holds s/cp positions of each
sequence, and its attention sends K/V each layer by `strategy.cp_mode` (`context_bytes`: the
bytes that leave the rank, forward and backward). The data-parallel bytes and the degrees come
from the strategy plugin (`data_traffic`, `mesh_dims`: framework.plugins.StrategyCapabilities).

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
from typing import Any

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
    prediction: Any = None  # its step on the device (framework.preflight.perf.Prediction)

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
    from framework.preflight.perf import count_replica, predict

    first = options[0].report
    work = count_replica(first.config, first_batch(first.config, first.plan))
    for o in options:
        o.prediction = predict(work, layout_facts(o.report, per_node), device)


def comm_bytes(cfg: DictConfig, report: CheckReport) -> float:
    """Bytes one rank sends per optimizer step under this layout (see the module docstring)."""
    return float(sum(traffic(cfg, report).values()))


def degrees_of(report: CheckReport) -> Any:
    """The layout's degrees on one mesh (None: a whole replica per process)."""
    return report.plan.dims


def traffic(cfg: DictConfig, report: CheckReport) -> dict[str, float]:
    """Bytes one rank sends per optimizer step, by the group that sends them: `data` (the
    plugin's data-parallel bytes), `tensor`, `pipeline`, `experts` (the module docstring)."""
    from framework.plugins import capability

    plugin, strategy, world = report.plugin, report.strategy, report.world
    dims = degrees_of(report)
    degrees = {"pp": dims.pp, "tp": dims.tp} if dims is not None else {"pp": 1, "tp": 1}
    cp = dims.cp if dims is not None else 1
    grads = max(r.grads for r in report.ranks)  # this rank's share of the gradients
    params = max(r.params for r in report.ranks)
    data = capability(plugin, "data_traffic")(strategy, world, grads, params)
    model = dict(cfg.task.model)
    act = activation_bytes(cfg) / cp  # a cp rank holds s/cp positions of each sequence
    n_layer = int(model.get("n_layer", 0))
    sent = {"data": float(data), "tensor": 0.0, "pipeline": 0.0, "experts": 0.0, "context": 0.0}
    if cp > 1:
        sent["context"] = context_traffic(cfg, strategy.cp_mode, cp, degrees["tp"]) / degrees["pp"]
    if degrees["tp"] > 1:
        sent["tensor"] = 4 * act * n_layer / degrees["pp"]
    if degrees["pp"] > 1:
        sent["pipeline"] = 2 * act
    if "num_experts" in model:
        sent["experts"] = 4 * act * int(model.get("top_k", 1)) * n_layer / degrees["pp"]
    return sent


def context_bytes(
    mode: str, cp: int, rows: int, seq: int, heads: int, kv_heads: int, head_dim: int,
    element: int,
) -> tuple[float, float]:  # fmt: skip
    """(Forward, backward) bytes one rank's context-parallel attention sends per layer per step
    (framework/nn/context.py), for `rows` sequences of `seq` positions, `heads` query and
    `kv_heads` key/value heads of `head_dim` on the rank, `element` bytes per value. A block is
    one rank's K and V: 2·b·s/cp·h_kv·d values.
    - ring: forward passes a block on cp-1 times, (cp-1)·2·b·s/cp·h_kv·d; backward passes each
      block again with its gradient (cp-1 times) and hands the gradient back (once);
    - allgather: the blocks all-gathered once, the same bytes as ring's forward; backward
      reduce-scatters their gradients ((cp-1)/cp of the cp blocks leave the rank);
    - ulysses: 4 all-to-alls of b·s/cp·h·d (q, k, v to heads, the output back; K/V heads
      repeated to h), forward and again backward, (cp-1)/cp of each leaving the rank.
    Gradients travel in fp32 at least (the merge accumulates in the softmax statistics' dtype).
    """
    if cp <= 1:
        return 0.0, 0.0
    block = 2 * rows * (seq // cp) * kv_heads * head_dim
    grad = max(element, 4)
    if mode == "ring":
        return float((cp - 1) * block * element), float((2 * cp - 1) * block * grad)
    if mode == "allgather":
        return float((cp - 1) * block * element), float((cp - 1) * block * grad)
    part = rows * (seq // cp) * heads * head_dim * element * (cp - 1) / cp
    return 4 * part, 4 * part


def attention_shape(cfg: DictConfig) -> dict[str, int]:
    """layers, heads, kv_heads, head_dim and seq of the task's model from its config: a
    framework.nn gpt's names (n_layer, n_head, n_embd, block_size) or a transformers config's
    (task.model.config: num_hidden_layers, num_attention_heads, ...; task.data.block_size);
    zeros where the config does not say."""
    model = dict(cfg.task.model)
    hf_config = dict(model.get("config") or {})
    layers = int(model.get("n_layer", hf_config.get("num_hidden_layers", 0)))
    heads = int(model.get("n_head", hf_config.get("num_attention_heads", 0)))
    kv_heads = int(model.get("n_kv_head", hf_config.get("num_key_value_heads") or heads))
    width = int(model.get("n_embd", hf_config.get("hidden_size", 0)))
    head_dim = int(hf_config.get("head_dim") or (width // heads if heads else 0))
    seq = int(model.get("block_size", cfg.task.data.get("block_size", 0)) or 0)
    return {"layers": layers, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
            "seq": seq}  # fmt: skip


def context_traffic(cfg: DictConfig, mode: str, cp: int, tp: int = 1) -> float:
    """Bytes one rank's context-parallel attention sends per optimizer step, every layer's
    forward and backward (tensor parallel splits the heads over tp)."""
    shape = attention_shape(cfg)
    rows = int(cfg.task.data.get("batch_size", 0))
    element = 2 if "16" in str(cfg.trainer.precision) else 4
    heads, kv_heads = shape["heads"] // tp, max(1, shape["kv_heads"] // tp)
    per_layer = context_bytes(
        mode, cp, rows, shape["seq"], heads, kv_heads, shape["head_dim"], element
    )
    return shape["layers"] * sum(per_layer)


def activation_bytes(cfg: DictConfig) -> int:
    """b x s x h of the per-rank batch, in the precision's bytes (2 under 16-bit, else 4)."""
    model = dict(cfg.task.model)
    rows, seq = int(cfg.task.data.get("batch_size", 0)), int(model.get("block_size", 0))
    width = int(model.get("n_embd", 0))
    return rows * seq * width * (2 if "16" in str(cfg.trainer.precision) else 4)


def layout_facts(report: CheckReport, per_node: int) -> dict[str, Any]:
    """What the performance model (framework/preflight/perf.py) needs of one checked layout:
    degrees, group sizes, which groups cross nodes, bytes by group, collectives per step, the
    schedule, and the worst rank's model states."""
    cfg, world = report.config, report.world
    dims = degrees_of(report)
    n = world.world_size
    data_ranks = report.plan.data_parallel[1]
    tp = dims.tp if dims is not None else 1
    pp = dims.pp if dims is not None else 1
    ep = dims.ep if dims is not None else 1
    cp = dims.cp if dims is not None else 1
    micro = int(getattr(report.strategy, "microbatches", 1)) if pp > 1 else 1
    virtual = int(getattr(report.strategy, "virtual_stages", 1)) if pp > 1 else 1
    n_layer = int(dict(cfg.task.model).get("n_layer", 0))
    many = n > per_node
    worst = report.worst
    return {
        "tp": tp,
        "pp": pp,
        "precision": str(cfg.trainer.precision),
        "data_ranks": data_ranks,
        "microbatches": micro,
        "virtual_stages": virtual,
        "traffic": traffic(cfg, report),
        "group_sizes": {
            "data": data_ranks,
            "tensor": tp,
            "experts": ep,
            "pipeline": pp,
            "context": cp,
        },
        # ranks are laid out pp, dp, fsdp, tp (tp innermost): a tensor group is adjacent
        "spans_nodes": {
            "data": many and data_ranks > 1 and n // pp > per_node,
            "tensor": tp > per_node,
            "experts": ep * tp > per_node,
            "pipeline": many and n // pp >= per_node,
            "context": cp * tp > per_node,  # a cp group's ranks are tp apart (dims.py)
        },
        "tensor_collectives": 4 * max(1, n_layer // pp) * micro,
        "expert_collectives": 4 * max(1, n_layer // pp) * micro,
        "pipeline_sends": 2 * micro * virtual,
        "context_collectives": context_collectives(report, cp) * max(1, n_layer // pp) * micro,
        "state_bytes": {"params": worst.params, "grads": worst.grads, "optimizer": worst.optimizer},
    }


def context_collectives(report: CheckReport, cp: int) -> int:
    """Collectives (or sends) of one layer's context-parallel attention in a step."""
    if cp <= 1:
        return 0
    mode = report.strategy.cp_mode
    return {"ring": 2 * cp - 1, "allgather": 2}.get(mode, 8)


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


SORTS = ("time", "cost", "simplicity")
WITHIN = 0.05  # the recommendation: the simplest layout within 5% of the best time


def predicted_rows(
    options: list[Option], base: list[str], gpus: int, tokens: float | None, price: float | None
) -> list[dict[str, Any]]:
    """One record per predicted option (the keys `fw plan --json` prints), simplest first."""
    found = []
    for o in options:
        p = o.prediction
        hours = tokens / p.tokens_per_s / 3600 if tokens else None
        found.append(
            {
                "layout": o.name,
                "overrides": [*base, *o.overrides],
                "order": o.order,
                "step_s": p.step_s,
                "tokens_per_s": p.tokens_per_s,
                "tokens_per_s_per_device": p.tokens_per_s / gpus,
                "mfu": p.mfu,
                "memory_gib": o.worst.total / 2**30,
                "hours": hours,
                "cost": hours * gpus * price if hours is not None and price is not None else None,
                "dominant": p.dominant,
                "terms_s": {
                    "compute": p.compute_s,
                    "communication": p.comm_s,
                    "bubble": p.bubble_s,
                    "optimizer": p.optimizer_s,
                    "data": p.data_s,
                },
            }
        )
    return found


def ranked(rows: list[dict[str, Any]], sort: str) -> list[dict[str, Any]]:
    """The rows in `sort` order, the recommended one marked (`recommended`: True)."""
    if sort not in SORTS:
        raise ConfigError("--sort", sort, "is not a sort order", list(SORTS))
    if not rows:
        return rows
    # time is time per token: the layouts' steps take different numbers of tokens
    best = max(r["tokens_per_s"] for r in rows)
    near = [r for r in rows if r["tokens_per_s"] * (1 + WITHIN) >= best]
    chosen = min(near, key=lambda r: r["order"])
    for r in rows:
        r["recommended"] = r is chosen
    if sort == "simplicity":
        key = lambda r: r["order"]  # noqa: E731
    elif sort == "cost" and all(r["cost"] is not None for r in rows):
        key = lambda r: (r["cost"], r["order"])  # noqa: E731
    else:  # cost without a price orders as time: GPU-hours follow the step time
        key = lambda r: (-r["tokens_per_s"], r["order"])  # noqa: E731
    return sorted(rows, key=key)


def time_table(rows: list[dict[str, Any]], refused, device, gpus: int, world: str) -> str:
    """The predicted layouts as a table, the recommended one marked `*`."""
    lines = [
        f"Layouts of the job over {gpus} x {device.name} that pass fw check, predicted "
        f"(* recommended: the simplest within {WITHIN:.0%} of the best time):"
    ]
    head = ("", "layout", "step s", "tokens/s", "per GPU", "MFU", "GiB", "hours", "cost",
            "bound by", "command")  # fmt: skip
    table_rows = [head]
    for i, r in enumerate(rows):
        table_rows.append(
            (
                "*" if r["recommended"] else str(i + 1),
                r["layout"],
                f"{r['step_s']:.4g}",
                f"{r['tokens_per_s']:.4g}",
                f"{r['tokens_per_s_per_device']:.4g}",
                f"{100 * r['mfu']:.1f}%",
                f"{r['memory_gib']:.2f}",
                "-" if r["hours"] is None else f"{r['hours']:.4g}",
                "-" if r["cost"] is None else f"{r['cost']:,.0f}",
                r["dominant"],
                " ".join(["fw", "train", *r["overrides"], world]),
            )
        )
    widths = [max(len(r[i]) for r in table_rows) for i in range(len(head))]
    lines += [
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in table_rows
    ]
    if not rows:
        lines.append("  none fits")
    if refused:
        lines.append("Left out:")
        lines += [f"  {name}: {why}" for name, why in refused]
    return "\n".join(lines)


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

    compose_config(overrides, dirs)  # a misspelled key is named here, not left out of each layout
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
