"""The job plan: what validation works out from a composed config, made once per process.

`plan_job` (framework/config/validate.py) makes it in the `fw` process after its checks: the
resolved config, the process layout (`World`), the strategy plugin with its typed config and
what the plugin says of it (its degrees on one mesh, the layout in words, the checkpoint
format, this rank's place among the data ranks, whether it saves in the background), and the
launcher plugin with its typed config. The runner hands it to the launcher. A worker in the
same process (one process, or a rank that torchrun or srun started) trains from that plan as
it is; a worker process of its own makes its plan from the run directory's frozen config.yaml
in one call (`for_worker`). No process types the strategy node or fits its degrees twice.
"""

from __future__ import annotations

import dataclasses
import json
import os
from types import ModuleType
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf

from framework import lr_scaling, secrets
from framework.plugins import capability, load_plugin, typed_config
from framework.world import World, env

if TYPE_CHECKING:
    from framework.parallel.dims import ParallelDims


@dataclasses.dataclass(frozen=True)
class JobPlan:
    """One job as validated: its config, layout, typed plugin configs and the strategy's facts."""

    cfg: DictConfig  # composed and resolved (secret values in place)
    world: World  # the process layout; in a worker, with this process's rank
    strategy_plugin: ModuleType  # the module `strategy.kind` names
    strategy: Any  # its typed `Config`
    dims: ParallelDims | None  # the degrees on one DeviceMesh (`mesh_dims`), or None
    layout: str  # the strategy in a few words for this world (`describe`)
    checkpoint_format: str  # what the strategy's checkpoints are written as
    data_parallel: tuple[int, int]  # (rank, size) among the ranks that read different data
    saves_async: bool  # whether the strategy writes checkpoints in the background
    launcher_plugin: ModuleType | None = None  # `launcher.kind`'s module (None: not asked for)
    launcher: Any = None  # its typed `Config`

    def for_this_process(self) -> JobPlan:
        """This plan as the process that trains from it sees it: its rank (from the torchrun
        or SLURM variables, as `World.current` reads them), its place among the data ranks, and
        a plain copy of the config, as a worker that reads config.yaml holds it."""
        world = dataclasses.replace(
            self.world,
            world_size=int(env("WORLD_SIZE", "SLURM_NTASKS", self.world.world_size)),
            rank=int(env("RANK", "SLURM_PROCID", 0)),
            local_rank=int(env("LOCAL_RANK", "SLURM_LOCALID", 0)),
        )
        data_parallel = self.data_parallel
        if world != self.world:
            data_parallel = tuple(self.strategy_plugin.data_parallel(self.strategy, world))
        cfg = OmegaConf.create(OmegaConf.to_container(self.cfg))
        return dataclasses.replace(self, cfg=cfg, world=world, data_parallel=data_parallel)


def make(cfg: DictConfig, world: World, plugin: ModuleType, strategy: Any) -> JobPlan:
    """The plan of a job whose strategy node is typed (`strategy`): the plugin is asked, once
    each, for what the runner, the worker and `fw check` need of it."""
    return JobPlan(
        cfg=cfg,
        world=world,
        strategy_plugin=plugin,
        strategy=strategy,
        dims=capability(plugin, "mesh_dims")(strategy, world),
        layout=capability(plugin, "describe")(strategy, world),
        checkpoint_format=plugin.checkpoint_format(strategy, world),
        data_parallel=tuple(plugin.data_parallel(strategy, world)),
        saves_async=bool(capability(plugin, "saves_async")(strategy, world)),
    )


def for_worker(job: JobPlan | DictConfig) -> JobPlan:
    """A worker's plan, in one call: the plan made in this process (`JobPlan`), for this rank;
    or the frozen config.yaml as read (`DictConfig`), with the secret values it leaves out put
    back, a previous start's record of the learning-rate rule dropped, this process's world
    read and the strategy typed."""
    if isinstance(job, JobPlan):
        return job.for_this_process()
    cfg = lr_scaling.without_record(with_secrets(job))
    world = World.current(cfg.trainer)
    plugin = load_plugin("strategy", cfg.strategy.kind, "strategy.kind")
    return make(cfg, world, plugin, typed_config(plugin, cfg.strategy, "strategy"))


def with_secrets(cfg: DictConfig) -> DictConfig:
    """Put back the secret values that config.yaml holds only as '***' (the `fw` process hands
    them to its workers in the environment, framework.secrets.ENV)."""
    for key, value in json.loads(os.environ.get(secrets.ENV, "{}")).items():
        OmegaConf.update(cfg, key, value, merge=False)
    return cfg
