"""Trainer settings that Lightning compares with the number of batches, compared before launch.

Lightning checks `val_check_interval`, `limit_train_batches`, `limit_val_batches` and
`overfit_batches` against the loaders only once every worker has loaded its data
(`FitLoop.setup_data`, `_parse_num_batches`): a mistake there is a traceback from each worker after
the run directory was written. The dry build has the data module already, so the same comparisons
run here, on the number of batches one data-parallel rank draws, and fail as a ConfigError.
"""

from __future__ import annotations

import math
from typing import Any

from framework.errors import ConfigError

INF = float("inf")


def check_batches(trainer: Any, data: Any, ranks: int) -> None:
    """Refuse a trainer setting Lightning would refuse once `data` is loaded on `ranks`
    data-parallel ranks. Nothing is checked where Lightning replaces the settings
    (fast_dev_run) or where the data module cannot be set up here (the workers will say)."""
    trainer = as_lightning_reads(trainer)
    if data is None or trainer.get("fast_dev_run") or not _asks_for_lengths(trainer):
        return
    try:
        data.setup("fit")
        train = rank_batches(data.train_dataloader(), ranks)
    except Exception:  # e.g. it needs the distributed environment: the workers report it
        return
    if train is None:
        return
    overfit = trainer.get("overfit_batches") or 0
    train_key = "trainer.overfit_batches" if overfit else "trainer.limit_train_batches"
    train_limit = overfit if overfit else trainer.get("limit_train_batches")
    batches = limited(train_key, train, train_limit, ranks)
    # limit_train_batches=0: no training asked for (fw train refuses it in check_trainer; an
    # evaluation trains nothing), so an empty epoch says nothing of the batch size
    no_training = train_limit == 0 and not isinstance(train_limit, bool)
    if batches == 0 and not no_training:
        raise ConfigError(
            "task.data",
            type(data).__name__,
            f"its train_dataloader gives no batch to a data-parallel rank (of {ranks})",
            hint="Use a smaller task.data.batch_size, more data, or fewer processes.",
        )
    val_limit = overfit if overfit else trainer.get("limit_val_batches")
    if val_limit != 0:
        check_val_limit(
            data,
            "trainer.overfit_batches" if overfit else "trainer.limit_val_batches",
            val_limit,
            ranks,
        )
    if not no_training:
        check_val_interval(trainer, batches, val_limit)


LIMITS = ("val_check_interval", "limit_train_batches", "limit_val_batches", "overfit_batches")


def as_lightning_reads(trainer: Any) -> dict[str, Any]:
    """The trainer settings as Lightning's Trainer reads them (`_determine_batch_limits`): a
    whole float above 1 is a number of batches (1000.0 is 1000); any other float above 1 is
    refused there, in every worker, so it is refused here."""
    settings = {key: trainer.get(key) for key in trainer}
    for key in LIMITS:
        value = settings.get(key)
        if isinstance(value, float) and value > 1:
            if value % 1:
                raise ConfigError(
                    f"trainer.{key}",
                    value,
                    "neither a fraction in [0, 1] nor a whole number of batches",
                    hint=f"Use a fraction such as 0.5 or a number of batches such as {int(value)}.",
                )
            settings[key] = int(value)
    return settings


def _asks_for_lengths(trainer: Any) -> bool:
    """Whether a setting depends on the loaders' lengths; only then is the data set up here
    (a data module's `setup` may take a while)."""
    interval = trainer.get("val_check_interval")
    if isinstance(interval, int) or (isinstance(interval, float) and interval != 1.0):
        return True
    limits = [trainer.get(k) for k in ("limit_train_batches", "limit_val_batches")]
    return bool(trainer.get("overfit_batches")) or any(
        v is not None and v != 1.0 and not isinstance(v, bool) for v in limits
    )


def check_val_limit(data: Any, key: str, limit: Any, ranks: int) -> None:
    try:
        loaders = data.val_dataloader()
    except Exception:  # no validation data, or it needs the workers' environment
        return
    for loader in loaders if isinstance(loaders, (list, tuple)) else [loaders]:
        batches = rank_batches(loader, ranks)
        if batches is not None:
            limited(key, batches, limit, ranks)


def check_val_interval(trainer: Any, batches: float, val_limit: Any) -> None:
    """As FitLoop.setup_data: an int interval longer than the epoch never validates (unless
    validation is by step only), and a fraction of an epoch needs an epoch length."""
    interval = trainer.get("val_check_interval")
    if isinstance(interval, bool) or interval is None or val_limit == 0:
        return
    if isinstance(interval, int):
        if interval > batches and trainer.get("check_val_every_n_epoch") is not None:
            raise ConfigError(
                "trainer.val_check_interval",
                interval,
                f"more than the {batches} training batches of an epoch (per data-parallel rank, "
                "after limit_train_batches): Lightning refuses it",
                hint=f"Use at most {batches}, or trainer.check_val_every_n_epoch=null to "
                "validate every N batches across epochs, or trainer.limit_val_batches=0.",
            )
    elif isinstance(interval, float) and interval != 1.0 and batches == INF:
        raise ConfigError(
            "trainer.val_check_interval",
            interval,
            "a fraction of an epoch, but the training data is an iterable dataset with no length",
            hint="Give an int (validate every N batches) or 1.0.",
        )


def limited(key: str, batches: float, limit: Any, ranks: int) -> float:
    """The batches Lightning runs from `batches` under `limit` (`_parse_num_batches`), or a
    ConfigError where Lightning raises one."""
    if limit is None or isinstance(limit, bool) or batches == 0:
        return batches
    if isinstance(limit, int):
        return min(batches, limit)
    if batches == INF:
        if limit != 1.0:
            raise ConfigError(
                key,
                limit,
                "a fraction, but the data is an iterable dataset with no length",
                hint="Give an int (a number of batches) or 1.0.",
            )
        return batches
    kept = int(batches * limit)
    if kept == 0 and limit > 0:
        raise ConfigError(
            key,
            limit,
            f"keeps no batch of the {int(batches)} each of the {ranks} data-parallel ranks has",
            hint=f"Use at least {1.0 / batches:.4g}, or an int (a number of batches).",
        )
    return kept


def rank_batches(loader: Any, ranks: int) -> float | None:
    """Batches one of `ranks` data-parallel ranks draws from `loader` in an epoch: inf for an
    iterable dataset, None where it cannot be known here (a custom batch sampler)."""
    # here, not at the top: `fw train` refuses a bad override before torch is imported
    from torch.utils.data import IterableDataset

    from framework.data.sampler import GlobalOrderSampler

    if isinstance(getattr(loader, "dataset", None), IterableDataset):
        return INF
    sampler, size = getattr(loader, "sampler", None), getattr(loader, "batch_size", None)
    if sampler is None or size is None:
        return len(loader) if ranks == 1 and hasattr(loader, "__len__") else None
    if isinstance(sampler, GlobalOrderSampler):
        total = sampler.total
        # a training order drops the ragged tail over the ranks; an evaluation order pads it
        samples = total // ranks if sampler.drop_last else math.ceil(total / ranks)
    else:  # Lightning's DistributedSampler (or our global order, padded): a padded share
        samples = math.ceil(len(sampler) / ranks)
    return samples // size if loader.drop_last else math.ceil(samples / size)
