"""`logger=wandb`: Weights & Biases tracking that follows the run across restarts.

One W&B run per job, created on rank 0 only, with the run id chosen when the run directory was
made (run.json), so a restarted job logs to the same run (`resume="allow"`). Without an API key
it logs offline into the run directory and says which command uploads it later; it never
prompts and never waits on the network for long. The resolved config (secrets redacted) is
recorded once. With `log_model`, committed checkpoints become versions of the artifact
`model-<run id>` (offline: recorded for `wandb sync`).
"""

from __future__ import annotations

import netrc
import os
from dataclasses import dataclass
from urllib.parse import urlparse

from framework.config.fields import doc
from framework.errors import ConfigError

MODES = ("auto", "online", "offline", "disabled")
LOG_MODEL = ("none", "last", "best", "all")


@dataclass
class Config:
    """Weights & Biases experiment tracking."""

    kind: str = doc("wandb", "Logger plugin.")
    mode: str = doc("auto", "auto: online when an API key is configured, else offline.", MODES)
    project: str | None = doc(None, "W&B project (None: $WANDB_PROJECT, else 'framework').")
    entity: str | None = doc(None, "W&B team or user (None: $WANDB_ENTITY or your default).")
    group: str | None = doc(None, "Group of runs (None: the sweep's name in a multirun).")
    tags: list[str] = doc([], "Tags shown in the W&B UI.")
    name: str | None = doc(None, "Display name (None: run.name, else the run directory's name).")
    notes: str | None = doc(None, "A longer description of the run.")
    init_timeout: float = doc(
        30.0, "Seconds to wait for the W&B server before going offline.", above=0
    )
    log_model: str = doc(
        "none",
        "Checkpoints as W&B artifacts, uploaded by rank 0 once committed: last (the newest "
        "only), best (each new best by callbacks.checkpoint.monitor), all (every one); none: off.",
        LOG_MODEL,
    )


def validate(cfg: Config, world) -> None:
    if resolve_mode(cfg) == "disabled":
        return
    try:
        import importlib.util

        found = importlib.util.find_spec("wandb") is not None
    except ValueError:
        found = False
    if not found:
        raise ConfigError(
            "logger.wandb",
            cfg.kind,
            "the wandb package is not installed",
            hint="Install it with `pip install 'framework[wandb]'`, or drop it: logger=[csv].",
        )


def check_job(cfg: Config, name: str, job) -> None:
    """Uploading checkpoints needs checkpoints, and `best` needs a ranking."""
    which = cfg.log_model
    if which == "none":
        return
    ckpt = (job.get("callbacks") or {}).get("checkpoint")
    if ckpt is None:
        raise ConfigError(
            f"logger.{name}.log_model",
            which,
            "no checkpoints are saved to upload: callbacks.checkpoint is off",
            ["none"],
            near="",
            hint="Keep the checkpoint callback (it is in the default callbacks), or "
            f"logger.{name}.log_model=none.",
        )
    if which == "best" and not ckpt.get("monitor"):
        raise ConfigError(
            f"logger.{name}.log_model",
            which,
            "'best' ranks checkpoints by callbacks.checkpoint.monitor, which is not set",
            ["none", "last", "all"],
            near="",
            hint="Name the metric, e.g. callbacks.checkpoint.monitor=val/loss "
            "(callbacks.checkpoint.mode=min|max).",
        )


def groups_runs(cfg: Config) -> bool:
    """A sweep puts its trials' runs in one group, named after the study, unless one is set."""
    return cfg.group is None


def resolve_mode(cfg: Config) -> str:
    """The mode this run will use: the config's, else $WANDB_MODE, else by API-key presence."""
    if cfg.mode != "auto":
        return cfg.mode
    env = os.environ.get("WANDB_MODE")
    if env in ("online", "offline", "disabled"):
        return env
    if env == "dryrun":
        return "offline"
    return "online" if has_api_key() else "offline"


def has_api_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return netrc.netrc().authenticators(host or "api.wandb.ai") is not None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


def build(cfg: Config, ctx):
    if resolve_mode(cfg) == "disabled":
        return None  # no logger at all: works without the wandb package
    from framework.loggers.wandb.logger import make_logger

    return make_logger(cfg, ctx, resolve_mode(cfg))
