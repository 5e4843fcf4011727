"""Options of the preflight commands (`fw check`, `fw plan`, `fw calibrate`) and `fw prepare`."""

from __future__ import annotations

from framework.errors import ConfigError


def take_option(args: list[str], name: str) -> tuple[str | None, list[str]]:
    """The value of `--name VALUE` or `--name=VALUE` in `args`, and the other words."""
    value, rest, words = None, [], iter(args)
    for word in words:
        if word == name:
            value = next(words, None)
            if value is None:
                raise ConfigError(name, None, "needs a value")
        elif word.startswith(name + "="):
            value = word.partition("=")[2]
        else:
            rest.append(word)
    return value, rest
