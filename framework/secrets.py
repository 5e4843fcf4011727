"""Secrets never reach disk or the console: one redaction for everything the framework or
Lightning writes (config.yaml, checkpoint hyperparameters, logger hyperparameters, log lines,
error messages).

A value is secret when its config key looks like a credential (`token`, `api_key`, `secret`,
`password`, `credential`, ... or the extra names in `run.secret_keys`), or when it is the value
of a credential environment variable (`WANDB_API_KEY`, any `*_TOKEN`, `*_SECRET*`, ...).
Secret keys are shown as `'***'`; secret values are also replaced wherever else they appear as
text (a hyperparameter under another name, a log line). The running task still receives the
real value.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from typing import Any

REDACTED = "***"
ENV = "FW_SECRET_VALUES"  # the secret config values, handed to the workers outside config.yaml
WORDS = ("api[_-]?key", "token", "secret", "password", "passwd", "credential", "private[_-]?key")
ENV_WORDS = (*WORDS, "auth")
MIN_LENGTH = 6  # shorter values are not scrubbed from free text (too many false hits)


def key_pattern(extra: Iterable[str] = ()) -> re.Pattern[str]:
    """Config keys whose values are secret: the built-in words plus `extra` (regexes)."""
    return re.compile("|".join((*WORDS, *extra)), re.IGNORECASE)


SECRET = key_pattern()


def is_secret_key(key: Any, pattern: re.Pattern[str] = SECRET) -> bool:
    return bool(pattern.search(str(key)))


def redact(node: Any, pattern: re.Pattern[str] = SECRET) -> Any:
    """A copy of a config container with the values of secret-looking keys replaced."""
    if isinstance(node, Mapping):
        return {
            k: (
                REDACTED
                if is_secret_key(k, pattern) and v not in (None, "")
                else redact(v, pattern)
            )
            for k, v in node.items()
        }
    if isinstance(node, (list, tuple)):
        return type(node)(redact(v, pattern) for v in node)
    return node


def values_under_secret_keys(node: Any, pattern: re.Pattern[str] = SECRET) -> set[str]:
    """The string values of secret-looking keys anywhere in a config container."""
    found: set[str] = set()
    if isinstance(node, Mapping):
        for k, v in node.items():
            if is_secret_key(k, pattern) and isinstance(v, (str, int)) and str(v):
                found.add(str(v))
            else:
                found |= values_under_secret_keys(v, pattern)
    elif isinstance(node, (list, tuple)):
        for v in node:
            found |= values_under_secret_keys(v, pattern)
    return found


def environment_credentials(environ: Mapping[str, str] | None = None) -> set[str]:
    """Values of environment variables that hold credentials (by name)."""
    environ = os.environ if environ is None else environ
    pattern = re.compile("|".join(ENV_WORDS), re.IGNORECASE)
    return {v for k, v in environ.items() if pattern.search(k) and len(v) >= MIN_LENGTH}


def scrub(obj: Any, values: Iterable[str]) -> Any:
    """A copy of `obj` (containers of strings and numbers) with every occurrence of a secret
    value in its strings replaced by '***'."""
    values = sorted((v for v in set(values) if len(v) >= MIN_LENGTH), key=len, reverse=True)
    if not values:
        return obj
    return _scrub(obj, values)


def _scrub(obj: Any, values: list[str]) -> Any:
    if isinstance(obj, str):
        for value in values:
            obj = obj.replace(value, REDACTED)
        return obj
    if isinstance(obj, Mapping):
        return {k: _scrub(v, values) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_scrub(v, values) for v in obj)
    return obj


def clean(params: Any, values: Iterable[str], pattern: re.Pattern[str] = SECRET) -> Any:
    """Hyperparameters as they may be written: secret keys redacted, secret values scrubbed."""
    return scrub(redact(dict(params) if isinstance(params, Mapping) else params, pattern), values)
