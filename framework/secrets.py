"""Secrets never reach disk or the console: one redactor for everything the framework or
Lightning writes or prints (config.yaml, meta.json, run.json, checkpoint and logger
hyperparameters, W&B's config and command line, sweep logs and study attributes, log lines,
error messages).

It knows three kinds of secret:
- a value under a config key that looks like a credential (`token`, `api_key`, `secret`,
  `password`, `passphrase`, `pwd`, `auth`, `authorization`, `credential`, any `*_key`, ... or
  the extra names in `run.secret_keys`; not `tokens`, a count, nor `tokenizer`, nor `author`),
  shown as `'***'` (a true/false under such a key is a setting, not a secret: shown);
- the password of a URL (`scheme://user:password@host`), wherever it appears as text;
- the value of a credential environment variable (`WANDB_API_KEY`, `HF_TOKEN`, any `*_TOKEN`,
  `*_KEY`, `*_SECRET*`, `*_PASSWORD`, ...), and the secret config values the framework hands its
  workers (ENV), wherever they appear as text: a value resolved from `${oc.env:HF_TOKEN}` under
  any key, a hyperparameter under another name, a log line, a command line.
The running task still receives the real values (ENV carries them past config.yaml).

A value of six characters or more is scrubbed wherever it appears; a shorter one (a config's
short password) only where it stands alone as a word, so that `pin=42` does not turn every "42"
inside a longer number into '***'.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping
from typing import Any

REDACTED = "***"
ENV = "FW_SECRET_VALUES"  # the secret config values, handed to the workers outside config.yaml
# `token` (hf_token, WANDB_API_TOKEN, rdzv_token) but not `tokenizer` (a path to a vocabulary,
# e.g. task.data.tokenizer), a count of tokens (`fw plan --tokens 1e12`, max_tokens,
# tokens_per_s) or a token's id in a vocabulary (pad_token_id): those are numbers and paths a
# user must see. A plural that names credentials (auth_tokens, access_tokens) is still secret.
WORDS = (
    "api[_-]?key",
    "token(?!i[sz]|s|[_-]?ids?(?![a-z]))",
    "(auth|access|api|bearer|refresh|session)[_-]?tokens",
    "secret",
    "password",
    "passwd",
    "passphrase",
    "pwd",
    "credential",
    "private[_-]?key",
    "[_-]key$",  # signing_key, ssh_key, encryption_key (not `keys`, a list of names)
    "auth(?!or)",  # auth, oauth, basic_auth, authentication; not author, authority
    "authori[sz]ation",
    "cookie",
)
# environment variable names: the key words, and a name ending in KEY (OPENAI_KEY, ...)
ENV_NAME = re.compile("|".join((*WORDS, r"(^|_)KEY$")), re.IGNORECASE)
NOT_CREDENTIALS = ("PWD", "OLDPWD")  # the shell's working directories, not passwords
MIN_LENGTH = 6  # shorter values are scrubbed from free text only as whole words
# `scheme://user:password@host`: the password ends at '@'; a '/' first means a port and a path
# (`http://host:8080/a@b`), not a password
URL_PASSWORD = re.compile(r"(\b[A-Za-z][\w+.-]*://[^\s:/@]*:)([^\s@/]+)(?=@)")


def key_pattern(extra: Iterable[str] = ()) -> re.Pattern[str]:
    """Config keys whose values are secret: the built-in words plus `extra` (regexes)."""
    return re.compile("|".join((*WORDS, *extra)), re.IGNORECASE)


SECRET = key_pattern()


# `run.secret_keys` holds key names, not secrets: written as it is, so a process reading the
# run's config.yaml knows them (a '***' in its place was compiled as a pattern and failed)
NAMES_OF_SECRETS = "secret_keys"


def is_secret_key(key: Any, pattern: re.Pattern[str] = SECRET) -> bool:
    return str(key) != NAMES_OF_SECRETS and bool(pattern.search(str(key)))


def redact(
    node: Any, pattern: re.Pattern[str] = SECRET, values: Iterable[str] | None = None
) -> Any:
    """A copy of a config container as it may be written: the values of secret-looking keys
    replaced, URL passwords and secret `values` (default: the environment's credentials)
    scrubbed from every string."""
    values = environment_credentials() if values is None else values
    return scrub(_redact_keys(node, pattern), values)


def _redact_keys(node: Any, pattern: re.Pattern[str]) -> Any:
    if isinstance(node, Mapping):
        return {
            k: (
                REDACTED
                if is_secret_key(k, pattern) and v not in (None, "") and not isinstance(v, bool)
                else _redact_keys(v, pattern)
            )
            for k, v in node.items()
        }
    if isinstance(node, (list, tuple)):
        return type(node)(_redact_keys(v, pattern) for v in node)
    return node


def redact_text(text: str, values: Iterable[str] | None = None) -> str:
    """`text` as it may be printed or written: URL passwords and secret `values` (default: the
    environment's credentials) replaced by '***'."""
    return scrub(text, environment_credentials() if values is None else values)


def redact_words(
    words: Iterable[str], pattern: re.Pattern[str] = SECRET, values: Iterable[str] | None = None
) -> list[str]:
    """Command-line words as they may be shown: the value of a secret-looking `KEY=VALUE`
    replaced (whatever its length), then as `redact_text`."""
    values = environment_credentials() if values is None else set(values)
    values = set(values) | command_line_secrets(words, pattern)
    shown = []
    for word in words:
        key, eq, _ = word.partition("=")
        shown.append(f"{key}={REDACTED}" if eq and is_secret_key(key, pattern) else word)
    return [redact_text(w, values) for w in shown]


def command_line_secrets(words: Iterable[str], pattern: re.Pattern[str] = SECRET) -> set[str]:
    """The values given on a command line under secret-looking keys (`+extra.api_token=X`,
    `--rdzv_token=X`), each element of a list value (`key=[a,b]`) too: what an error message
    about those words must not repeat (a parser's message quotes the value it choked on)."""
    found: set[str] = set()
    for word in words:
        key, eq, value = str(word).partition("=")
        if eq and is_secret_key(key, pattern):
            found |= parts_of(value)
    return found


def parts_of(value: Any) -> set[str]:
    """A secret value as text, and, for a list (or a list written `[a, 'b']`), each element
    with and without its quotes."""
    if value is None or isinstance(value, bool):
        return set()
    if isinstance(value, (list, tuple, set)):
        return set().union(*(parts_of(v) for v in value)) if value else set()
    text = str(value)
    found = {text} if text else set()
    inner = text.strip()
    if inner.startswith("[") and inner.endswith("]"):
        for element in inner[1:-1].split(","):
            element = element.strip()
            found |= {element, element.strip("'\"")} - {""}
    return found


def values_under_secret_keys(node: Any, pattern: re.Pattern[str] = SECRET) -> set[str]:
    """The string values of secret-looking keys anywhere in a config container (a number only
    when it is long enough to be told from an ordinary one; never true/false)."""
    found: set[str] = set()
    if isinstance(node, Mapping):
        for k, v in node.items():
            if is_secret_key(k, pattern) and _secret_leaf(v):
                found.add(str(v))
            elif is_secret_key(k, pattern) and isinstance(v, (list, tuple)):
                found |= {str(x) for x in _leaves(v) if _secret_leaf(x)}
            else:
                found |= values_under_secret_keys(v, pattern)
    elif isinstance(node, (list, tuple)):
        for v in node:
            found |= values_under_secret_keys(v, pattern)
    return found


def secret_values(plain: Any, pattern: re.Pattern[str] = SECRET) -> set[str]:
    """Every value never to write for a config: those under secret keys, the passwords of its
    URLs, and the environment's credentials."""
    passwords = {m.group(2) for text in _strings(plain) for m in URL_PASSWORD.finditer(text)}
    return values_under_secret_keys(plain, pattern) | passwords | environment_credentials()


def _secret_leaf(value: Any) -> bool:
    """Whether a value under a secret key is scrubbed from text: any non-empty string; a number
    of MIN_LENGTH digits or more (a timeout under `auth_timeout` is not a secret, and its "30"
    scrubbed from every log line would hide the step numbers); never true/false."""
    if isinstance(value, bool) or value is None:
        return False
    if isinstance(value, str):
        return bool(value)
    return isinstance(value, (int, float)) and len(str(value)) >= MIN_LENGTH


def _strings(node: Any) -> Iterable[str]:
    return (v for v in _leaves(node) if isinstance(v, str))


def _leaves(node: Any) -> Iterable[Any]:
    if isinstance(node, Mapping):
        for v in node.values():
            yield from _leaves(v)
    elif isinstance(node, (list, tuple)):
        for v in node:
            yield from _leaves(v)
    else:
        yield node


def environment_credentials(environ: Mapping[str, str] | None = None) -> set[str]:
    """Values of environment variables that hold credentials (by name), and the secret config
    values the framework hands its workers (ENV)."""
    environ = os.environ if environ is None else environ
    found = {
        v
        for k, v in environ.items()
        if ENV_NAME.search(k) and k not in NOT_CREDENTIALS and len(v) >= MIN_LENGTH
    }
    try:
        handed = json.loads(environ.get(ENV, "{}"))
    except ValueError:
        handed = {}
    found.discard(environ.get(ENV, ""))  # its name says secret; its values count one by one
    handed_values = {str(v) for v in _leaves(list(handed.values())) if _secret_leaf(v)}
    passwords = {m.group(2) for v in handed_values for m in URL_PASSWORD.finditer(v)}
    return found | handed_values | passwords


def process_secrets() -> set[str]:
    """Every secret this process knows of: the environment's credentials, the secret config
    values handed to the workers, and the values given under secret keys on its command line
    (what a message printed or written by it must not hold)."""
    import sys

    return environment_credentials() | command_line_secrets(sys.argv[1:])


def scrub(obj: Any, values: Iterable[str]) -> Any:
    """A copy of `obj` (containers of strings and numbers) with URL passwords and every
    occurrence of a secret value in its strings replaced by '***' (a value shorter than
    MIN_LENGTH only where it stands alone, not inside a longer word or number)."""
    values = {str(v) for v in values if str(v)} - {REDACTED}
    long = sorted((v for v in values if len(v) >= MIN_LENGTH), key=len, reverse=True)
    short = sorted((v for v in values if len(v) < MIN_LENGTH), key=len, reverse=True)
    whole = None
    if short:
        alternatives = "|".join(re.escape(v) for v in short)
        whole = re.compile(rf"(?<![A-Za-z0-9_])(?:{alternatives})(?![A-Za-z0-9_])")
    return _scrub(obj, long, whole)


def _scrub(obj: Any, values: list[str], whole: re.Pattern[str] | None) -> Any:
    if isinstance(obj, str):
        obj = URL_PASSWORD.sub(rf"\1{REDACTED}", obj)
        for value in values:
            obj = obj.replace(value, REDACTED)
        return whole.sub(REDACTED, obj) if whole is not None else obj
    if isinstance(obj, Mapping):
        return {k: _scrub(v, values, whole) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_scrub(v, values, whole) for v in obj)
    return obj


def clean(params: Any, values: Iterable[str], pattern: re.Pattern[str] = SECRET) -> Any:
    """Hyperparameters as they may be written: secret keys redacted, secret values scrubbed."""
    return redact(dict(params) if isinstance(params, Mapping) else params, pattern, values)
