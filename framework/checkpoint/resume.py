"""Choosing what a job resumes from, before any process starts (`resume=auto|never|PATH`)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from framework.checkpoint import disk
from framework.context import config_changes
from framework.errors import ConfigError
from framework.plugins import describe_strategy

log = logging.getLogger("framework.checkpoint.resume")


def choose(
    mode: str,
    run_dir: Path,
    config: dict[str, Any],
    ckpt_format: str = "lightning",
    world_size: int = 1,
    check_move: Callable[[str], None] | None = None,
    trust: bool = False,
) -> Path | None:
    """The checkpoint directory to resume from, or None to start at step 0. Unless `trust`, a
    checkpoint whose pickles name more than data is refused (framework.checkpoint.safe)."""
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
        disk.remove_incomplete(run_dir / "checkpoints")
        ckpt = disk.newest_complete(run_dir / "checkpoints")
        if ckpt is None:
            log.warning("No complete checkpoint in %s: starting again from step 0.", run_dir)
            return None
    else:
        ckpt = disk.resolve(Path(mode), "resume")
    if not trust:
        check_safe(ckpt, "resume")
    check_compatible(ckpt, config)
    check_layout(ckpt, ckpt_format, world_size, check_move)
    return ckpt


def check_safe(ckpt: Path, key: str) -> None:
    """Refuse a checkpoint that loading could make run code; `--trust` loads it anyway."""
    from framework.checkpoint.safe import UnsafeCheckpoint, check_checkpoint

    try:
        check_checkpoint(ckpt)
    except UnsafeCheckpoint as err:
        raise ConfigError(
            key,
            str(ckpt),
            f"loading it could run code: {err}",
            hint="Load only checkpoints you trust; add --trust to load this one anyway.",
        ) from None


def needs_move(meta: dict[str, Any], ckpt_format: str, world_size: int) -> bool:
    """Whether a checkpoint must be converted to load under this strategy and process count.

    Plain Lightning checkpoints (ddp) load as they are under any process count; sharded ones
    (DeepSpeed, DCP) as they are only under the strategy and process count that wrote them.
    """
    saved_format, saved_world = meta.get("format", "lightning"), int(meta.get("world_size", 1))
    if saved_format != ckpt_format:
        return True
    return saved_format != "lightning" and saved_world != world_size


def check_layout(
    ckpt: Path,
    ckpt_format: str,
    world_size: int,
    check_move: Callable[[str], None] | None = None,
) -> None:
    """Refuse, before anything starts, a move to another layout that cannot be made.

    `check_move(source)` is the strategy plugin's `check_move` bound to its config: it raises
    ConfigError when the strategy cannot take in a checkpoint from another layout.
    """
    meta = disk.read_meta(ckpt)
    if not needs_move(meta, ckpt_format, world_size):
        return
    saved_format = meta.get("format", "lightning")
    if saved_format == "lightning" and not meta.get("parameter_names", False):
        raise ConfigError(
            "strategy",
            ckpt_format,
            f"the checkpoint {ckpt.name} was written by ddp before checkpoints recorded "
            "parameter names, so its optimizer state cannot be moved to another strategy",
            hint="Resume it with strategy=ddp; its next checkpoint can then be moved.",
        )
    if check_move is not None:  # the strategy's own limits (e.g. DeepSpeed's NVMe offload)
        check_move(
            f"the checkpoint {ckpt.name} was written by {meta.get('world_size', 1)} "
            f"process(es) in the '{saved_format}' layout"
        )
    log.info(
        "Moving checkpoint %s: %s with %s process(es) -> %s with %d",
        ckpt.name,
        saved_format,
        meta.get("world_size", 1),
        ckpt_format,
        world_size,
    )


def check_compatible(ckpt: Path, config: dict[str, Any]) -> None:
    """Refuse a checkpoint whose model/optimizer config differs; list harmless changes."""
    saved = disk.read_meta(ckpt).get("config", {})
    breaking, harmless = config_changes(saved, config, describe_strategy)
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
