"""The one exception type for mistakes a user can make in a config or on the command line."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any

EXIT_FAILED = 1  # a worker failed
EXIT_CONFIG = 2  # a configuration or usage error (ConfigError)
EXIT_PREEMPTED = 75  # stopped on SIGTERM/SIGUSR1 after a checkpoint (EX_TEMPFAIL): run it again
EXIT_TERMINATED = 143  # stopped on SIGTERM with no checkpoint taken on it (128 + SIGTERM)


class ConfigError(Exception):
    """A configuration or usage error: printed as one paragraph by the CLI, exit code 2."""

    def __init__(
        self,
        key: str,
        value: Any,
        problem: str,
        choices: Iterable[Any] | None = None,
        hint: str | None = None,
        near: str | None = None,
    ) -> None:
        from framework import secrets

        self.key = key
        if _secret_key(key) and value not in (None, "") and not isinstance(value, bool):
            # an error message is printed: never a credential, nor a parser's quote of it
            hidden = secrets.parts_of(value)
            value = secrets.REDACTED
            problem = secrets.scrub(problem, hidden)
            hint = secrets.scrub(hint, hidden) if hint else hint
        elif isinstance(value, str) and "=" in value:  # override words: `a.api_token=X b=1`
            value = " ".join(secrets.redact_words(value.split(" ")))
        self.value = value
        self.problem = problem
        self.choices = [str(c) for c in choices] if choices is not None else None
        self.hint = hint
        # Suggest a close match for names, not for numbers (64 is not "close" to 4).
        numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
        self.near = near if near is not None else (None if numeric else str(value))
        super().__init__(self.render())

    def render(self) -> str:
        parts = [f"{self.key}={_short(self.value)}: {self.problem}."]
        if self.choices is not None:
            close = difflib.get_close_matches(self.near, self.choices, n=1) if self.near else []
            if close:
                parts.append(f"Did you mean '{close[0]}'?")
            listed = ", ".join(self.choices) if self.choices else "(none)"
            parts.append(f"Valid choices: {listed}.")
        if self.hint:
            parts.append(self.hint)
        return " ".join(parts)


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value) if not isinstance(value, str) else value
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _secret_key(key: str) -> bool:
    from framework.secrets import SECRET

    return bool(SECRET.search(str(key).rpartition(".")[2]))
