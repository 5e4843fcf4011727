"""Choosing what a job resumes from, before any process starts (`resume=auto|never|PATH`)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from framework import checkpointing
from framework.context import config_changes
from framework.errors import ConfigError

log = logging.getLogger("framework.resume")


def choose(
    mode: str,
    run_dir: Path,
    config: dict[str, Any],
    ckpt_format: str = "lightning",
    world_size: int = 1,
) -> Path | None:
    """The checkpoint directory to resume from, or None to start at step 0."""
    existing = (run_dir / "config.yaml").exists()
    if mode == "never":
        if existing:
            raise ConfigError(
                "resume",
                mode,
                f"run.dir {run_dir} already holds a run",
                hint="Choose a new run.dir, or resume=auto to continue it.",
            )
        return None
    if mode == "auto":
        if not existing:
            return None
        checkpointing.remove_incomplete(run_dir / "checkpoints")
        ckpt = checkpointing.newest_complete(run_dir / "checkpoints")
        if ckpt is None:
            log.warning("No complete checkpoint in %s: starting again from step 0.", run_dir)
            return None
    else:
        ckpt = checkpointing.resolve(Path(mode), "resume")
    check_compatible(ckpt, config)
    check_layout(ckpt, ckpt_format, world_size)
    return ckpt


def check_layout(ckpt: Path, ckpt_format: str, world_size: int) -> None:
    """Refuse moves between checkpoint layouts that cannot be loaded yet (before anything starts).

    Plain Lightning checkpoints (ddp) load under any process count; sharded ones (DeepSpeed,
    DCP) only under the strategy and process count that wrote them.
    """
    meta = checkpointing.read_meta(ckpt)
    saved_format, saved_world = meta.get("format", "lightning"), int(meta.get("world_size", 1))
    if saved_format != ckpt_format:
        raise ConfigError(
            "strategy",
            ckpt_format,
            f"the checkpoint {ckpt.name} was written in the '{saved_format}' "
            f"format, which this strategy cannot load (moving between strategies is not supported yet)",
            hint="Resume with the strategy that wrote it, or start a new run.dir.",
        )
    if saved_format != "lightning" and saved_world != world_size:
        raise ConfigError(
            "trainer.devices",
            world_size,
            f"the sharded checkpoint {ckpt.name} was written by "
            f"{saved_world} processes and can only be resumed by as many (resharding is not supported yet)",
            [str(saved_world)],
        )


def check_compatible(ckpt: Path, config: dict[str, Any]) -> None:
    """Refuse a checkpoint whose model/optimizer config differs; list harmless changes."""
    saved = checkpointing.read_meta(ckpt).get("config", {})
    breaking, harmless = config_changes(saved, config)
    if breaking:
        raise ConfigError(
            "resume",
            str(ckpt),
            "the checkpoint was made with a different model or optimizer ("
            + "; ".join(breaking)
            + ")",
            hint="Restore those values, or train in a new run.dir.",
        )
    if harmless:
        log.info("Resuming with changed settings: %s", "; ".join(harmless))
