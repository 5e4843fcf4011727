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
    if not existing and disk.listing(run_dir / "checkpoints"):
        raise ConfigError(
            "run.dir",
            str(run_dir),
            "holds checkpoints but no config.yaml: it is not a run directory this framework "
            "wrote, and its checkpoints would be loaded on the first restart",
            hint="Choose a new run.dir, or resume one of those checkpoints explicitly with "
            "resume=PATH.",
        )
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
    check_safe(ckpt, "resume", trust)
    check_compatible(ckpt, config)
    check_layout(ckpt, ckpt_format, world_size, check_move)
    return ckpt


def check_safe(ckpt: Path, key: str, trust: bool = False) -> None:
    """Refuse a checkpoint that loading could make run code; `trust` (`--trust`) loads its
    pickles anyway. A link inside it is refused either way (every open refuses one; refused
    here, it is an exit 2 before any process starts)."""
    from framework.checkpoint.formats import check_checkpoint
    from framework.checkpoint.portable import NotPortable
    from framework.checkpoint.safe import UnsafeCheckpoint, check_tree

    try:
        check_tree(ckpt)
    except UnsafeCheckpoint as err:
        raise ConfigError(
            key,
            str(ckpt),
            f"is not a plain checkpoint directory: {err}",
            hint="A checkpoint this framework writes holds no link, so --trust does not load "
            "one; copy a checkpoint you trust without its links (cp -rL) to load it.",
        ) from None
    if trust:
        return
    try:
        check_checkpoint(ckpt)
    except NotPortable as err:
        raise ConfigError(key, str(ckpt), f"is not a readable checkpoint: {err}") from None
    except UnsafeCheckpoint as err:
        raise ConfigError(
            key,
            str(ckpt),
            f"loading it could run code: {err}",
            hint="Load only checkpoints you trust; add --trust to load this one anyway.",
        ) from None


def needs_move(meta: dict[str, Any], ckpt_format: str, world_size: int) -> bool:
    """Whether a checkpoint is read into another layout than the one that wrote it: another
    format, or a format that loads as written only under the process count that wrote it
    (framework/checkpoint/formats: `any_world`). Every load reads by slices; a move is named in
    the log and checked against the strategy's own limits (`check_move`)."""
    from framework.checkpoint import formats

    saved = formats.of(meta)
    if saved.name != ckpt_format:
        return True
    return not saved.any_world and int(meta.get("world_size", 1)) != world_size


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
    from framework.checkpoint import formats

    meta = disk.read_meta(ckpt)
    if not needs_move(meta, ckpt_format, world_size):
        return
    saved = formats.of(meta)
    problem = saved.movable(meta)
    if problem:
        raise ConfigError(
            "strategy",
            ckpt_format,
            f"the checkpoint {ckpt.name} cannot be read into another layout: {problem}",
            hint=f"Resume it with strategy={describe_strategy(meta.get('config') or {})} "
            f"({meta.get('world_size', 1)} process(es)), the layout that wrote it; its next "
            "checkpoint can then be moved.",
        )
    if check_move is not None:  # the strategy's own limits (e.g. DeepSpeed's NVMe offload)
        check_move(
            f"the checkpoint {ckpt.name} was written by {meta.get('world_size', 1)} "
            f"process(es) in the '{saved.name}' layout"
        )
    log.info(
        "Moving checkpoint %s: %s with %s process(es) -> %s with %d",
        ckpt.name,
        saved.name,
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
