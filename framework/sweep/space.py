"""The search space of `fw sweep`, written in Hydra's sweep grammar, as Optuna distributions.

| written | searched |
|---|---|
| `key=interval(a, b)` | a float, uniform in [a, b] |
| `key=tag(log, interval(a, b))` | a float, log-uniform in [a, b] |
| `key=range(a, b[, step])` | a number of a, a+step, ... below b (as `fw train -m` expands it) |
| `key=tag(log, range(a, b))` | an integer, log-uniform over a..b-1 |
| `key=choice(x, y, ...)` or `key=x,y,...` | one of the values |
"""

from __future__ import annotations

import re
from typing import Any

from framework.errors import ConfigError

FORMS = (
    "interval(low, high)",
    "range(start, stop[, step])",
    "choice(a, b, ...)",
    "a,b,...",
    "tag(log, interval(...))",
    "tag(log, range(...))",
)
TAGS = ("log",)
PLAIN = re.compile(r"[\w./:+-]+")


def split_overrides(overrides: list[str]) -> tuple[dict[str, Any], list[str]]:
    """({key: Optuna distribution} searched, the other overrides, as written), in order."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    parser = OverridesParser.create()
    space: dict[str, Any] = {}
    fixed: list[str] = []
    for text in overrides:
        try:
            (override,) = parser.parse_overrides([text])
        except OverrideParseException as err:
            raise _parse_error(text, err) from None
        if not override.is_sweep_override():
            fixed.append(text)
            continue
        key = override.get_key_element()
        space[key] = distribution(key, text.partition("=")[2], override.value())
    return space, fixed


def _parse_error(text: str, err: Exception) -> ConfigError:
    found = re.search(r"Unknown function '(\w+)'", str(err))
    key, _, value = text.partition("=")
    if found:
        return ConfigError(
            key, value, f"unknown distribution '{found.group(1)}'", FORMS, near=found.group(1)
        )
    return ConfigError(
        "override",
        text,
        "not a valid override",
        hint=f"Write KEY=VALUE, or a search over KEY as one of: {', '.join(FORMS)}.",
    )


def distribution(key: str, written: str, sweep: Any) -> Any:
    """The Optuna distribution of one parsed Hydra sweep (a ConfigError when it has none)."""
    from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, RangeSweep
    from optuna.distributions import (
        CategoricalDistribution,
        FloatDistribution,
        IntDistribution,
    )

    unknown = set(sweep.tags) - set(TAGS)
    if unknown:
        raise ConfigError(key, written, f"unknown tag '{sorted(unknown)[0]}'", TAGS)
    log = "log" in sweep.tags
    try:
        if isinstance(sweep, IntervalSweep):
            return FloatDistribution(float(sweep.start), float(sweep.end), log=log)
        if isinstance(sweep, RangeSweep):
            return _range(sweep, log, IntDistribution, FloatDistribution)
        if isinstance(sweep, ChoiceSweep):
            if log:
                raise ValueError("tag(log, ...) applies to interval and range, not to a choice")
            if getattr(sweep, "shuffle", False):
                raise ValueError("shuffle has no meaning in a search")
            return CategoricalDistribution(sweep.list)
    except ValueError as err:
        raise ConfigError(key, written, str(err).rstrip(".")) from None
    raise ConfigError(key, written, "not a distribution", FORMS)


def _range(sweep: Any, log: bool, int_dist: type, float_dist: type) -> Any:
    """Hydra's range stops before `stop` (as `fw train -m` expands it); Optuna's high is in it."""
    start, stop, step = sweep.start, sweep.stop, sweep.step or 1
    if (stop - start) * step <= 0:
        raise ValueError(f"range({start}, {stop}, {step}) holds no value")
    last = start + step * int((stop - start - step * 1e-9) // step)
    if all(isinstance(v, int) for v in (start, stop, step)):
        return int_dist(start, last, log=log, step=1 if log else step)
    return float_dist(float(start), float(last), log=log, step=None if log else float(step))


def override(key: str, value: Any) -> str:
    """`key=value` as a Hydra override that gives back this exact value."""
    return f"{key}={literal(value)}"


def literal(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    text = str(value)
    if PLAIN.fullmatch(text) and not _looks_typed(text):
        return text
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _looks_typed(text: str) -> bool:
    """A string Hydra would read as a number, bool or null when written bare."""
    if text.lower() in ("true", "false", "null", "nan", "inf", "-inf", "+inf"):
        return True
    try:
        float(text)
    except ValueError:
        return False
    return True


def corners(space: dict[str, Any]) -> list[list[str]]:
    """The overrides of the lowest and of the highest point of the space (checked before the
    search starts: a typo in a key, or a value the config refuses, fails there)."""
    low, high = [], []
    for key, dist in space.items():
        values = dist.choices if hasattr(dist, "choices") else (dist.low, dist.high)
        low.append(override(key, values[0]))
        high.append(override(key, values[-1]))
    return [low, high] if high != low else [low]
