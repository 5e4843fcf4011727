"""Console logging for the `fw` process and the workers: rank-zero aware, noise filtered."""

from __future__ import annotations

import logging
import sys
import warnings

from framework.world import global_rank

NOISE = ("💡 Tip:",)


class _ScrubSecrets(logging.Filter):
    """Replace URL passwords and credential values (environment, the secret config values the
    workers are handed) in every message."""

    def filter(self, record: logging.LogRecord) -> bool:
        from framework.secrets import redact_text

        record.msg = redact_text(record.getMessage())
        record.args = ()
        return True


class _DropNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(NOISE)


def setup_logging(rank: int | None = None) -> None:
    """`framework` logs at INFO on rank 0 (WARNING elsewhere); known third-party noise is dropped."""
    rank = global_rank() if rank is None else rank
    logger = logging.getLogger("framework")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[fw] %(message)s"))
        handler.addFilter(_ScrubSecrets())
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    logging.getLogger("torch.distributed.elastic").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.* is deprecated")
    warnings.filterwarnings("ignore", message=".*reduce_scatter_tensor.* is deprecated")
    # The data position is restored by callbacks.checkpoint through GlobalOrderSampler.
    warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended before")
    warnings.filterwarnings("ignore", message=".*`isinstance\\(treespec, LeafSpec\\)`.*")


def quiet_lightning() -> None:
    """Drop Lightning's advertising lines; call after Lightning has set up its handlers."""
    for name in ("lightning.pytorch", "lightning.fabric"):
        for handler in logging.getLogger(name).handlers:
            if not any(isinstance(f, _DropNoise) for f in handler.filters):
                handler.addFilter(_DropNoise())
