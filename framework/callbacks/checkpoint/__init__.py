"""`callbacks.checkpoint`: atomic, verified checkpoints for exact resume, and preemption.

Checkpoints go to `<run dir>/checkpoints/stepNNNNNNNN/` (see framework.checkpoint.disk). Each holds
everything needed to continue as if nothing happened: model, optimizer, LR schedulers, precision
scaler, the loops' progress, every process's RNG states, the data position, the run id and the
config. SIGTERM, SIGUSR1 or SIGUSR2 (what SLURM sends before preempting) makes every rank save at the next
step boundary and exit with code 75, so a requeue script can start the same command again.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from framework.config.fields import doc

BEST = "best"  # checkpoints/best: the best by `monitor`, beside `last` (callback.py makes it)


@dataclass
class Config:
    """Save checkpoints every N steps and/or after validation; keep the last K and the best."""

    kind: str = doc("checkpoint", "Callback plugin.")
    every_n_steps: int | None = doc(
        None, "Save every N optimizer steps (None: after each validation).", min=1
    )
    keep_last: int = doc(2, "Keep the newest K checkpoints (at least 1).", min=1)
    keep_best: int = doc(1, "Also keep the best K by `monitor` (0: none).", min=0)
    monitor: str | None = doc(
        None,
        "Metric ranking checkpoints for keep_best and checkpoints/best (what fw test reads), "
        "e.g. val/loss; the run stops at its first validation if no part of the task logs it.",
    )
    mode: str = doc("min", "Whether a lower or a higher `monitor` value is better.", ("min", "max"))
    save_on_train_end: bool = doc(True, "Also save when training ends between checkpoints.")
    async_save: bool = doc(
        False,
        "Write checkpoints in the background (DCP's async_save; the DCP layouts of "
        "strategy=fsdp|tensor|fsdp_tp|pipeline|expert): training waits only while the state is "
        "copied; a checkpoint counts once complete; at most one save in flight.",
    )
    on_preemption: bool = doc(
        True,
        "On SIGTERM/SIGUSR1/SIGUSR2: save at a step boundary (the next, or the one after) and exit 75.",
    )


def validate(cfg: Config, world) -> None:
    """The fields' bounds are declared on them; nothing else to check before launch."""


def build(cfg: Config, ctx):
    from framework.callbacks.checkpoint.callback import Checkpointer

    return Checkpointer(cfg, ctx)


def chosen_checkpoint(ckpt_dir: Path) -> Path | None:
    """What an evaluation of a run reads by default (`fw test RUN_DIR`, `trainer.test_after_fit`):
    checkpoints/best when it is complete, else the newest complete checkpoint."""
    from framework.checkpoint import disk

    best = Path(ckpt_dir) / BEST
    if best.is_dir() and disk.verify(best.resolve()) is None:
        return best.resolve()
    return disk.newest_complete(Path(ckpt_dir))
