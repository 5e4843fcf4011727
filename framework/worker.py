"""Inside each worker: read the frozen config, build the Trainer and its parts, fit.

Started by the launcher as `python -m framework.worker RUN_DIR/config.yaml` (one process per
device, with torch's elastic environment variables), or called in-process for one process, or
under an external torchrun/SLURM job.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from framework.logs import quiet_lightning, setup_logging
from framework.plugins import load_plugin
from framework.world import World

log = logging.getLogger("framework.worker")

TRAINER_KEYS_SKIPPED = ("devices", "num_nodes", "accelerator")


def run(cfg: DictConfig, run_dir: Path) -> Any:
    """Train one job in this process; returns the fitted lightning.Trainer."""
    setup_logging()
    import lightning.pytorch as pl
    import torch

    quiet_lightning()
    world = World.current(cfg.trainer)
    limit_threads(world)
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    task = build_task(cfg.task)
    data = instantiate_args(cfg.task.data)
    strategy = load_plugin("strategy", cfg.strategy.kind, "strategy.kind").build(
        cfg.strategy, world
    )
    loggers = [
        load_plugin("logger", entry.kind, f"logger.{name}").build(
            entry, run_dir, run_name(cfg, run_dir)
        )
        for name, entry in (cfg.logger or {}).items()
        if entry is not None
    ]
    callbacks = [
        build_callback(name, entry, run_dir)
        for name, entry in (cfg.callbacks or {}).items()
        if entry is not None
    ]
    trainer_args = {
        k: v
        for k, v in OmegaConf.to_container(cfg.trainer).items()
        if k not in TRAINER_KEYS_SKIPPED and v is not None
    }
    if cfg.trainer.max_epochs is None:
        # Unset epochs: unlimited when a step budget is given, else one pass over the data.
        trainer_args["max_epochs"] = -1 if cfg.trainer.max_steps > 0 else 1
    if cfg.trainer.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
    trainer = pl.Trainer(
        accelerator="cuda" if world.is_cuda else "cpu",
        devices=world.devices,
        num_nodes=world.num_nodes,
        strategy=strategy,
        logger=loggers or False,
        callbacks=callbacks,
        enable_checkpointing=any(isinstance(c, pl.callbacks.ModelCheckpoint) for c in callbacks),
        default_root_dir=str(run_dir),
        **trainer_args,
    )
    trainer.fit(task, datamodule=data)
    close_process_group()
    if trainer.is_global_zero:
        log.info("Run finished at step %d. Outputs in %s", trainer.global_step, run_dir)
    return trainer


def close_process_group() -> None:
    """Leave the process group together: a rank exiting while a peer still talks to it aborts."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def limit_threads(world: World) -> None:
    """Share the CPU cores between the local processes instead of oversubscribing them."""
    if world.is_cuda or "OMP_NUM_THREADS" in os.environ:
        return
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, world.devices)))


def instantiate_args(node: DictConfig, **extra: Any) -> Any:
    from hydra.utils import get_class

    args = {k: v for k, v in OmegaConf.to_container(node, resolve=True).items() if k != "_target_"}
    return get_class(node._target_)(**args, **extra)


def build_task(task_cfg: DictConfig) -> Any:
    from hydra.utils import get_class

    from framework.task import TaskModule

    cls = get_class(task_cfg._target_)
    task = cls(**OmegaConf.to_container(task_cfg.model, resolve=True))
    if isinstance(task, TaskModule):
        task.configure_from(
            OmegaConf.to_container(task_cfg.optimizer, resolve=True),
            OmegaConf.to_container(task_cfg.scheduler, resolve=True),
        )
    return task


def build_callback(name: str, entry: DictConfig, run_dir: Path) -> Any:
    if "_target_" in entry:
        return instantiate_args(entry)
    return load_plugin("callbacks", entry.kind, f"callbacks.{name}.kind").build(entry, run_dir)


def run_name(cfg: DictConfig, run_dir: Path) -> str:
    return cfg.run.name or Path(run_dir).name


def main(argv: list[str] | None = None) -> None:
    from torch.distributed.elastic.multiprocessing.errors import record

    args = sys.argv[1:] if argv is None else argv
    config_path = Path(args[0])
    cfg = OmegaConf.load(config_path)
    record(run)(cfg, config_path.parent)


if __name__ == "__main__":
    main()
