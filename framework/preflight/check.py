"""`fw check OVERRIDES [--gpu-mem SIZE|GPU] [--ranks 0,7,...]`: the job's memory per rank, and
the failures its workers would meet, found in this one process before anything is queued.

The config is composed and validated as `fw train` does, for the machines it names (see
`validate(here=False)`), then representative ranks (the first and last rank of each pipeline
position) are run one step each on the fake backend (framework/preflight/simulate.py). DeepSpeed
strategies run one replica for the activations and take their model states from ZeRO's formulas:
DeepSpeed's own estimators under mixed precision, the fp32 figures the memory benchmark measured
otherwise.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from framework.errors import ConfigError
from framework.perf import gib, parse_memory
from framework.preflight.simulate import RankMemory

log = logging.getLogger("framework.preflight")


@dataclass
class CheckReport:
    """What `fw check` found: the layout, each representative rank's bytes, the device's."""

    layout: str
    world_size: int
    ranks: list[RankMemory]
    device_bytes: int | None = None
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    config: Any = None  # the composed, resolved config that was checked

    @property
    def worst(self) -> RankMemory:
        return max(self.ranks, key=lambda r: r.total)

    @property
    def fits(self) -> bool | None:
        return None if self.device_bytes is None else self.worst.total <= self.device_bytes

    def table(self) -> str:
        head = ("rank", "role", "params", "grads", "optimizer", "activations", "opt step", "total")
        rows = [(*head, "")]
        unit, scale = ("GiB", 2**30) if self.worst.total >= 2**30 else ("MiB", 2**20)
        for r in self.ranks:
            shares = [r.params, r.grads, r.optimizer, r.activations, r.optimizer_step, r.total]
            rows.append((str(r.rank), r.role, *(f"{n / scale:.3f}" for n in shares), r.note))
        widths = [max(len(row[i]) for row in rows) for i in range(len(head) + 1)]
        lines = [
            "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows
        ]
        lines.insert(1, "-" * len(lines[0]))
        verdict = [f"{self.layout}, {self.world_size} processes; {unit} per rank."]
        if self.device_bytes is not None:
            worst = self.worst
            word = "fits in" if self.fits else "does NOT fit in"
            verdict.append(
                f"Worst rank {worst.rank}: {gib(worst.total):.2f} GiB, {word} the device's "
                f"{gib(self.device_bytes):.1f} GiB ({100 * worst.total / self.device_bytes:.0f}%)."
            )
        return "\n".join([*verdict, *lines, *self.notes, f"Checked in {self.seconds:.1f} s."])


def check(
    overrides: list[str],
    extra_dirs: list[Path] | None = None,
    gpu_mem: str | None = None,
    ranks: list[int] | None = None,
    quick: bool = False,
) -> CheckReport:
    """Compose, validate and simulate the job; ConfigError for anything its workers would fail."""
    started = time.perf_counter()
    cfg, world = composed(overrides, extra_dirs)
    device = parse_memory("--gpu-mem", gpu_mem) if gpu_mem is not None else None
    batch = first_batch(cfg, world)
    for r in ranks or []:
        if not 0 <= r < world.world_size:
            raise ConfigError("--ranks", r, f"is not a rank of the {world.world_size} processes")
    if world.is_cuda or device is not None:  # a GPU target: nothing may stay on the CPU
        check_placement(cfg, world, batch, ranks)
    report = simulate(cfg, world, batch, ranks, quick)
    report.device_bytes = device
    report.config = cfg
    report.seconds = time.perf_counter() - started
    return report


def composed(overrides: list[str], extra_dirs: list[Path] | None) -> tuple[DictConfig, Any]:
    from framework.config.compose import compose_config
    from framework.config.validate import validate
    from framework.runner import resolve

    cfg = compose_config(overrides, extra_dirs)
    cfg.run.dir = str(Path(cfg.run.dir or "runs/check").resolve())
    resolve(cfg)
    return cfg, validate(cfg, here=False)


def first_batch(cfg: DictConfig, world) -> Any:
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
    ranks = data_ranks(cfg, world)
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


def data_ranks(cfg: DictConfig, world) -> int:
    from framework.plugins import load_plugin, typed_config

    plugin = load_plugin("strategy", cfg.strategy.kind, "strategy.kind")
    return plugin.data_parallel(typed_config(plugin, cfg.strategy), world)[1]


def representative(dims, chosen: list[int] | None, quick: bool = False) -> list[int]:
    """The first and last rank of each pipeline position (all differ in stages; ranks within a
    position differ only by uneven shards; `quick`: the first only), or the ranks asked for."""
    if chosen:
        return sorted(set(chosen))
    per = dims.world_size // dims.pp
    ends = (0,) if quick else (0, per - 1)
    return sorted({p * per + e for p in range(dims.pp) for e in ends})


def simulate(
    cfg: DictConfig, world, batch: Any, chosen: list[int] | None, quick: bool = False
) -> CheckReport:
    from framework.nn.transforms import ModelTransforms
    from framework.plugins import load_plugin, typed_config
    from framework.preflight import simulate as sim

    kind = cfg.strategy.kind
    plugin = load_plugin("strategy", kind, "strategy.kind")
    strategy = typed_config(plugin, cfg.strategy)
    transforms = ModelTransforms(cfg.trainer.activation_checkpointing, False)
    notes = []
    if cfg.trainer.compile:
        notes.append("trainer.compile is not applied in the check (eager memory is shown).")
    if kind == "parallel":
        dims = plugin.dims_of(strategy, world.world_size)
        rows = []
        for rank in representative(dims, chosen, quick):
            rows.append(
                failing_rank(
                    rank,
                    dims.describe(),
                    lambda r=rank: sim.parallel_rank(
                        cfg.task, cfg.trainer, batch, r, strategy, dims, transforms, world.is_cuda
                    ),
                )
            )
        if dims.pp > 1 and strategy.balance == "time":
            notes.append("balance=time cuts by measured time in the job; the check cuts by params.")
        return CheckReport(dims.describe(), world.world_size, rows, notes=notes)
    replica = failing_rank(
        0,
        kind,
        lambda: sim.replica_rank(
            cfg.task, cfg.trainer, batch, 0, world.world_size, transforms, world.is_cuda
        ),
    )
    if kind == "deepspeed":
        replica, note = zero_states(replica, strategy, cfg.trainer.precision, world)
        notes.append(note)
    name = f"zero{strategy.stage}" if kind == "deepspeed" else kind
    return CheckReport(f"{name} x {world.world_size}", world.world_size, [replica], notes=notes)


def check_placement(cfg: DictConfig, world, batch: Any, chosen: list[int] | None) -> None:
    """ConfigError when a rank of the parallel strategy would, on its GPU, keep a tensor on the
    CPU after setup or hand one to a collective (framework/preflight/devices.py); the first rank
    of each pipeline position, which differ in their stages (the others only in shard sizes).
    The other strategies move the whole module with Lightning's or DeepSpeed's own setup."""
    from framework.nn.transforms import ModelTransforms
    from framework.plugins import load_plugin, typed_config
    from framework.preflight.devices import placement_errors, refuse

    if cfg.strategy.kind != "parallel":
        return
    plugin = load_plugin("strategy", "parallel", "strategy.kind")
    strategy = typed_config(plugin, cfg.strategy)
    dims = plugin.dims_of(strategy, world.world_size)
    transforms = ModelTransforms(cfg.trainer.activation_checkpointing, False)
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


def zero_states(replica: RankMemory, cfg, precision: str, world) -> tuple[RankMemory, str]:
    """ZeRO's per-rank model states from the whole-model replica's bytes. Each rank steps the
    task's optimizer on its 1/N partition: 1/N of the replica's step temporaries, none on the
    device when the optimizer is offloaded."""
    n = world.world_size
    params, states = replica.params, replica.optimizer
    offload_opt = cfg.offload_optimizer != "none"
    offload_params = cfg.stage == 3 and cfg.offload_params != "none"
    step = 0 if offload_opt else replica.optimizer_step // n
    if precision in ("bf16-mixed", "16-mixed"):
        return deepspeed_estimate(replica, cfg, world, offload_opt, offload_params, step)
    # fp32, as benchmarks/memory.py measured: stages 1-2 keep an fp32 copy of their partition
    row = RankMemory(
        replica.rank,
        f"zero{cfg.stage}, every rank",
        0 if offload_params else (params // n if cfg.stage == 3 else params),
        params // n,
        0 if offload_opt else states // n + (params // n if cfg.stage < 3 else 0),
        replica.activations,
        step,
        "optimizer offloaded" if offload_opt else "",
    )
    return row, "ZeRO model states: the fp32 formulas the memory benchmark verified."


def deepspeed_estimate(replica, cfg, world, offload_opt, offload_params, step: int):
    psi = replica.params // 4
    if cfg.stage == 3:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

        _, device, _ = estimate_zero3_model_states_mem_needs(
            psi, psi, world.devices, world.num_nodes, offload_opt, offload_params
        )
    else:
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

        _, device = estimate_zero2_model_states_mem_needs(
            psi, world.devices, world.num_nodes, offload_opt
        )
    params = 2 * psi // (world.world_size if cfg.stage == 3 else 1)
    row = RankMemory(
        replica.rank,
        f"zero{cfg.stage}, every rank",
        params,
        0,
        max(0, device - params),
        replica.activations,
        step,
        "grads in optimizer column",
    )
    return row, (
        "ZeRO model states: DeepSpeed's estimator (16-bit params and grads, fp32 master and "
        "Adam states); its largest-layer term uses the whole model, an upper bound."
    )
