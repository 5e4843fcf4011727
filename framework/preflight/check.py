"""`fw check OVERRIDES [--gpu-mem SIZE|GPU] [--host-mem SIZE] [--ranks 0,7,...]`: the job's
memory per rank, the failures its workers would meet, and the host memory of its loads and
export (framework/preflight/phases.py), found in this one process before anything is queued.

The config is composed and validated as `fw train` does, for the machines it names (see
`plan_job(here=False)`), then representative ranks (the first and last rank of each pipeline
position) are run one step each on the fake backend (framework/preflight/simulate.py). What the
check needs from a strategy it asks the plugin (`framework.plugins.StrategyCapabilities`): its
degrees on one mesh, or, for a strategy that keeps a whole replica per process, one replica run
for the activations and the plugin's own share of the model states (ZeRO's formulas for
DeepSpeed).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from framework.config.job_plan import JobPlan
from framework.errors import ConfigError
from framework.perf import parse_memory
from framework.preflight.report import CheckReport, byte_unit

log = logging.getLogger("framework.preflight")


def check(
    overrides: list[str],
    extra_dirs: list[Path] | None = None,
    gpu_mem: str | None = None,
    ranks: list[int] | None = None,
    quick: bool = False,
    host_mem: str | None = None,
) -> CheckReport:
    """Compose, validate and simulate the job; ConfigError for anything its workers would fail
    (`host_mem`: a node's host memory, which the peaks of its loads and export must fit)."""
    started = time.perf_counter()
    cfg, plan = composed(overrides, extra_dirs)
    world = plan.world
    device = parse_memory("--gpu-mem", gpu_mem) if gpu_mem is not None else None
    batch = first_batch(cfg, plan)
    for r in ranks or []:
        if not 0 <= r < world.world_size:
            raise ConfigError("--ranks", r, f"is not a rank of the {world.world_size} processes")
    if world.is_cuda or device is not None:  # a GPU target: nothing may stay on the CPU
        check_placement(cfg, plan, batch, ranks)
    report = simulate(cfg, plan, batch, ranks, quick)
    report.device_bytes = device
    report.config = cfg
    report.world = world
    report.plan = plan
    count_sent(cfg, report)
    host = parse_memory("--host-mem", host_mem) if host_mem is not None else None
    check_phases(cfg, plan, report, host)
    report.seconds = time.perf_counter() - started
    return report


def check_phases(cfg: DictConfig, plan: JobPlan, report: CheckReport, host: int | None) -> None:
    """The memory of a pretrained load, a resume and an export (framework/preflight/phases.py)
    as notes under the table; ConfigError when a node's ranks would not fit `host` bytes."""
    import torch

    from framework.instantiate import build_task
    from framework.preflight import phases

    with torch.device("meta"):
        model = build_task(cfg.task)
    found = phases.phases(cfg, model)
    worst = report.worst
    report.notes += phases.notes(found, worst.params, worst.optimizer)
    if host is None:
        return
    per_node = plan.world.devices
    for phase in found:
        peak = phases.host_peak(phase, worst.params, worst.optimizer, not plan.world.is_cuda) * (
            1 if phase.name == "export" else per_node
        )
        if peak > host:
            unit, scale = byte_unit(max(peak, host))
            raise ConfigError(
                "--host-mem",
                f"{host / scale:.3f}{unit}",
                f"the {phase.name} would need about {peak / scale:.3f} {unit} of host memory on "
                f"a node ({per_node} rank(s): {phase.what})",
                hint="Use more nodes or fewer ranks per node, or a node with more memory.",
            )


def count_sent(cfg: DictConfig, report: CheckReport) -> None:
    """Each checked rank's bytes sent per step by group (framework/preflight/traffic.py), and
    under context parallel a note with the K/V share: its bytes per layer, forward and
    backward as `strategy.cp_mode` sends them, times the layers."""
    from framework.preflight import traffic

    report.sent = {r.rank: traffic.rank_traffic(cfg, report, r) for r in report.ranks}
    dims = report.plan.dims
    if dims is None or dims.cp == 1:
        return
    mode = report.strategy.cp_mode
    forward, backward, layers = traffic.context_per_layer(cfg, mode, dims.cp, dims.tp)
    kv = max(s["context"] for s in report.sent.values())
    unit, scale = byte_unit(max(forward, backward))
    total_unit, total_scale = byte_unit(kv)
    stages = f" / pp={dims.pp}" if dims.pp > 1 else ""
    report.notes.append(
        f"Context parallel ({mode}, cp={dims.cp}): K/V sent per step {kv / total_scale:.3f} "
        f"{total_unit} of the sent column: {forward / scale:.3f} {unit} forward + "
        f"{backward / scale:.3f} {unit} backward a layer x {layers} layers{stages}."
    )


def composed(overrides: list[str], extra_dirs: list[Path] | None) -> tuple[DictConfig, JobPlan]:
    """The composed, resolved config and the plan its validation made (for the machines it
    names)."""
    from framework.config.compose import compose_config
    from framework.config.validate import plan_job
    from framework.runner import resolve

    cfg = compose_config(overrides, extra_dirs)
    cfg.run.dir = str(Path(cfg.run.dir or "runs/check").resolve())
    resolve(cfg)
    return cfg, plan_job(cfg, here=False)


def first_batch(cfg: DictConfig, plan: JobPlan) -> Any:
    """One training batch of this rank's size from the task's own data module (shapes only are
    used); ConfigError when the data ranks would get no full batch."""
    import torch

    from framework.instantiate import instantiate_args

    torch.manual_seed(int(cfg.seed))
    data = instantiate_args(cfg.task.data)
    try:
        data.setup("fit")
        loader = data.train_dataloader()
        batch = next(iter(loader))
    except StopIteration:
        batch = None
    except Exception as err:
        raise ConfigError(
            "task.data", cfg.task.data._target_, f"raised {type(err).__name__}: {err}"
        ) from None
    ranks = plan.data_parallel[1]
    dataset = getattr(loader, "dataset", None)
    size = len(dataset) if hasattr(dataset, "__len__") else None
    per_rank = getattr(loader, "batch_size", None)
    if batch is None or (size is not None and per_rank and size < ranks * per_rank):
        raise ConfigError(
            "task.data.batch_size",
            per_rank,
            f"the training set's {size} samples give no full batch to each of the {ranks} "
            "data-parallel ranks (the workers would train no step)",
            hint="Use more data, a smaller batch, or fewer data-parallel ranks.",
        )
    return batch


def representative(dims, chosen: list[int] | None, quick: bool = False) -> list[int]:
    """The first and last rank of each pipeline position (all differ in stages; ranks within a
    position differ only by uneven shards; `quick`: the first only), or the ranks asked for."""
    if chosen:
        return sorted(set(chosen))
    per = dims.world_size // dims.pp
    ends = (0,) if quick else (0, per - 1)
    return sorted({p * per + e for p in range(dims.pp) for e in ends})


def simulate(
    cfg: DictConfig, plan: JobPlan, batch: Any, chosen: list[int] | None, quick: bool = False
) -> CheckReport:
    from framework.parallel import float8
    from framework.parallel.transforms import ModelTransforms
    from framework.plugins import capability
    from framework.preflight import simulate as sim

    kind = cfg.strategy.kind
    plugin, strategy, world, dims = plan.strategy_plugin, plan.strategy, plan.world, plan.dims
    transforms = ModelTransforms(
        cfg.trainer.activation_checkpointing, False, float8.settings_for(cfg.trainer, world.is_cuda)
    )
    notes = []
    if cfg.trainer.compile:
        notes.append("trainer.compile is not applied in the check (eager memory is shown).")
    layout = plan.layout
    if dims is not None:
        rows = []
        for rank in representative(dims, chosen, quick):
            rows.append(
                failing_rank(
                    rank,
                    layout,
                    lambda r=rank: sim.parallel_rank(
                        cfg.task, cfg.trainer, batch, r, strategy, dims, transforms, world.is_cuda
                    ),
                )
            )
        notes += capability(plugin, "preflight_notes")(strategy, world)
        return CheckReport(
            layout, world.world_size, rows, notes=notes, plugin=plugin, strategy=strategy
        )
    replica = failing_rank(
        0,
        kind,
        lambda: sim.replica_rank(
            cfg.task, cfg.trainer, batch, 0, world.world_size, transforms, world.is_cuda
        ),
    )
    replica, note = capability(plugin, "model_states")(
        strategy, world, replica, cfg.trainer.precision
    )
    notes += [note] if note else []
    notes += capability(plugin, "preflight_notes")(strategy, world)
    return CheckReport(
        layout, world.world_size, [replica], notes=notes, plugin=plugin, strategy=strategy
    )


def check_placement(cfg: DictConfig, plan: JobPlan, batch: Any, chosen: list[int] | None) -> None:
    """ConfigError when a rank of a strategy on one mesh (`mesh_dims`) would, on its GPU, keep a
    tensor on the CPU after setup or hand one to a collective (framework/preflight/devices.py);
    the first rank of each pipeline position, which differ in their stages (the others only in
    shard sizes). The other strategies move the whole module with Lightning's or DeepSpeed's
    own setup."""
    from framework.parallel import float8
    from framework.parallel.transforms import ModelTransforms
    from framework.preflight.devices import placement_errors, refuse

    strategy, dims = plan.strategy, plan.dims
    if dims is None:
        return
    transforms = ModelTransforms(
        cfg.trainer.activation_checkpointing, False, float8.settings_for(cfg.trainer, True)
    )
    for rank in representative(dims, chosen, quick=True):
        errors = failing_rank(
            rank,
            dims.describe(),
            lambda r=rank: placement_errors(
                cfg.task, cfg.trainer, batch, r, strategy, dims, transforms
            ),
        )
        if errors:
            raise refuse(rank, dims.describe(), errors)


def failing_rank(rank: int, layout: str, run) -> Any:
    """The rank's figures; what would fail in that worker becomes a ConfigError naming it."""
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    level = fake_log.level
    fake_log.setLevel(logging.CRITICAL)  # it logs the error we report, with its traceback
    try:
        return run()
    except ConfigError:
        raise
    except Exception as err:
        first = str(err).strip().splitlines()[0].rstrip(".") if str(err).strip() else ""
        raise ConfigError(
            "strategy",
            layout,
            f"rank {rank} would fail in its first step: {type(err).__name__}: {first}",
            hint="`fw train` would raise it once the processes started; fix the degrees, plan "
            "or model shape it names.",
        ) from None
    finally:
        fake_log.setLevel(level)
