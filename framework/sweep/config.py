"""The `sweep` settings of `fw sweep`: what to optimise and how, from `conf/sweep/<name>.yaml`
(`sweep=NAME`, default `default`) and `sweep.KEY=VALUE` overrides.

These settings belong to the search, not to a training job: trials never see them.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from framework.config.fields import check_fields, doc, schema_error
from framework.errors import ConfigError

SAMPLERS = {"tpe": "TPESampler", "random": "RandomSampler"}
PRUNERS = {"median": "MedianPruner", "successive_halving": "SuccessiveHalvingPruner", "none": None}


@dataclass
class SweepConfig:
    """A search: the metric it optimises, how it samples and prunes, and its search space."""

    metric: str = doc("val/loss", "Logged metric (a metrics.csv column) the search optimises.")
    direction: str = doc(
        "minimize", "Whether a lower or a higher metric is better.", ("minimize", "maximize")
    )
    sampler: str = doc(
        "tpe", "How the next trial's values are chosen (Optuna sampler).", tuple(SAMPLERS)
    )
    sampler_args: dict[str, Any] = doc(
        {}, "Keyword arguments of the Optuna sampler (e.g. n_startup_trials)."
    )
    pruner: str = doc(
        "median",
        "Stop a trial early when its validation metric falls behind (median: the median of "
        "earlier trials at the same step; successive_halving; none).",
        tuple(PRUNERS),
    )
    pruner_args: dict[str, Any] = doc(
        {}, "Keyword arguments of the Optuna pruner (e.g. n_warmup_steps)."
    )
    seed: int | None = doc(
        None,
        "Seed of the sampler (None: random). Each trial's draw is seeded with seed + the number "
        "of trials before it, so resumed and parallel searches draw new values.",
        min=0,
    )
    heartbeat_s: int = doc(
        60,
        "Seconds between a running trial's heartbeats in the study. A trial silent for three of "
        "them (its sweep process died, on any machine) is marked failed by the next sweep "
        "process that looks for work.",
        min=1,
    )
    params: dict[str, str] = doc(
        {},
        "Search space by config key, in the sweep grammar (e.g. 'tag(log, interval(1e-4, 1e-2))'); "
        "KEY=... searches on the command line are added to it.",
    )


def load(overrides: list[str], conf_dirs: list[Path]) -> tuple[SweepConfig, list[str]]:
    """(the sweep settings, the overrides that are not `sweep` ones)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    name, own, rest = "default", [], []
    for text in overrides:
        key, _, value = text.lstrip("+").partition("=")
        if key == "sweep":
            name = value
        elif key.startswith("sweep."):
            own.append(f"{key[len('sweep.') :]}={value}")
        else:
            rest.append(text)
    options = {p.stem: p for d in reversed(conf_dirs) for p in (d / "sweep").glob("*.yaml")}
    if name not in options:
        raise ConfigError("sweep", name, "no such option in group 'sweep'", sorted(options))
    try:
        node = OmegaConf.merge(
            OmegaConf.structured(SweepConfig),
            OmegaConf.load(options[name]),
            OmegaConf.from_dotlist(own),
        )
        cfg = OmegaConf.to_object(node)
    except OmegaConfBaseException as err:
        field = getattr(err, "full_key", "") or ""
        names = [f.name for f in dataclasses.fields(SweepConfig)]
        raise schema_error(err, f"sweep.{field}", "?", names) from None
    check_fields(cfg, "sweep.")
    return cfg, rest


def sampler(cfg: SweepConfig, seed: int | None) -> Any:
    """The Optuna sampler the settings name (seeded with `seed`)."""
    import optuna

    cls = getattr(optuna.samplers, SAMPLERS[cfg.sampler])
    return _build(cls, {**cfg.sampler_args, "seed": seed}, "sweep.sampler_args")


def pruner(name: str, args: dict[str, Any]) -> Any:
    """The Optuna pruner `name` with keyword arguments `args` (shared with the trial's callback)."""
    import optuna

    if PRUNERS[name] is None:
        return optuna.pruners.NopPruner()
    return _build(getattr(optuna.pruners, PRUNERS[name]), args, "sweep.pruner_args")


def _build(cls: type, args: dict[str, Any], key: str) -> Any:
    accepted = list(inspect.signature(cls).parameters)
    unknown = [a for a in args if a not in accepted]
    if unknown:
        raise ConfigError(
            f"{key}.{unknown[0]}", args[unknown[0]], f"not an argument of {cls.__name__}", accepted
        )
    try:
        return cls(**args)
    except (TypeError, ValueError) as err:
        raise ConfigError(key, args, f"{cls.__name__}: {err}".rstrip(".")) from None
