"""Secrets never reach a line moerl prints or writes: errors, events, error.log, `moerl config`, W&B's config.

    redact(text)            the values of the environment's secret-looking variables, `NAME=value` and
                            `'NAME': 'value'` pairs whose NAME looks secret, credentials inside a URL
                            (scheme://user:secret@host) and known token shapes (sk-..., ghp_..., AKIA...) replaced
                            by ***
    redact_config(d)        a config as plain dicts, the values of secret-looking keys, URL credentials and token
                            shapes masked
    looks_secret(name)      an environment name such as AWS_SECRET_ACCESS_KEY, HF_TOKEN, DB_PASSWORD, OPENAI_API_KEY
    secret_in_value(value)  what credential a value holds by its shape, whatever its name (None if none)

Two rules of names: an environment variable (upper case) looks secret when a word of it is SECRET, TOKEN,
PASSWORD, ... or its last word is KEY; a config key (lower case, such as the task's `answer_key` or
`prompt_key`, which name fields and hold no secret) only when it names a secret outright (`api_key`,
`access_key`, `token`, `password`, `secret...`). Standard library only: every layer may import it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from typing import Any

MASK = "***"
_SECRET_WORDS = frozenset({"SECRET", "TOKEN", "PASSWORD", "PASSWD", "CREDENTIAL", "CREDENTIALS", "APIKEY"})
_MIN_VALUE = 4  # shorter values (`1`, `true`) would mask ordinary text everywhere
# `NAME=value`, `NAME: value`, `'NAME': 'value'`, `"NAME" = "value"` (a dict's repr, TOML, a shell line)
_PAIR = re.compile(r"""(?P<q>['"]?)(?P<name>[A-Z][A-Z0-9_]*)(?P=q)(?P<sep>\s*[:=]\s*)(?P<vq>['"]?)(?P<value>[^'"\s,}\]]+)(?P=vq)""")
_URL_USERINFO = re.compile(r"(?P<scheme>\b[a-zA-Z][a-zA-Z0-9+.-]*://)[^/@\s'\"]+@")
_URL_PASSWORD = re.compile(r"\b[a-zA-Z][a-zA-Z0-9+.-]*://[^/@\s:'\"]*:[^/@\s'\"]+@")
# Credentials by their shape, whatever the name they are stored under: (what it is, pattern). Prefixes that their
# issuers document, long enough a tail that ordinary words and paths do not match.
_TOKEN_SHAPES = (
    ("an OpenAI-style API key (sk-...)", re.compile(r"\bsk-[A-Za-z0-9_-]{20,}")),
    ("a GitHub token (ghp_..., gho_..., github_pat_...)",
     re.compile(r"\b(?:gh[pousr]_[A-Za-z0-9]{30,}|github_pat_[A-Za-z0-9_]{30,})")),
    ("an AWS access key id (AKIA...)", re.compile(r"\b(?:AKIA|ASIA)[A-Z0-9]{16}\b")),
    ("a Hugging Face token (hf_...)", re.compile(r"\bhf_[A-Za-z0-9]{30,}")),
    ("a Slack token (xox...)", re.compile(r"\bxox[abposr]-[A-Za-z0-9-]{10,}")),
    ("a GitLab token (glpat-...)", re.compile(r"\bglpat-[A-Za-z0-9_-]{20,}")),
    ("a Google API key (AIza...)", re.compile(r"\bAIza[0-9A-Za-z_-]{35}")),
    ("a private key (-----BEGIN ... PRIVATE KEY-----)", re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----")),
    ("a JSON web token (eyJ...)", re.compile(r"\beyJ[A-Za-z0-9_-]{10,}\.eyJ[A-Za-z0-9_-]{10,}\.[A-Za-z0-9_-]+")),
)


def looks_secret(name: str) -> bool:
    """An environment name that holds a credential: AWS_SECRET_ACCESS_KEY, HF_TOKEN, DB_PASSWORD, OPENAI_API_KEY,
    GITHUB_TOKEN (not TOKENIZERS_PARALLELISM: whole words only)."""
    words = name.upper().split("_")
    return bool(_SECRET_WORDS.intersection(words)) or words[-1] == "KEY" or "ACCESS_KEY" in name.upper()


def secret_key(key: str) -> bool:
    """A config key (the last part of a dotted key) that names a secret. `answer_key`, `prompt_key` and
    `max_new_tokens` do not; `api_key`, `access_key`, `hf_token`, `password`, `aws_secret_access_key` do."""
    last = key.rsplit(".", 1)[-1]
    if last.isupper():  # an environment name used as a key (launch.env)
        return looks_secret(last)
    words = last.lower().split("_")
    return (bool({"secret", "token", "password", "passwd", "credential", "credentials", "apikey"} & set(words))
            or last.lower().endswith(("api_key", "access_key", "private_key", "secret_key", "auth_key")))


def secret_in_value(value: str) -> str | None:
    """What credential `value` holds by its shape (a password inside a URL, a known token's prefix), else None.
    Never the value itself: the answer is safe to print."""
    if _URL_PASSWORD.search(value):
        return "a password inside a URL (scheme://user:password@host)"
    return next((what for what, shape in _TOKEN_SHAPES if shape.search(value)), None)


def secret_values(env: Mapping[str, str] | None = None) -> list[str]:
    """The values of `env`'s (default: os.environ's) secret-looking variables, longest first."""
    env = os.environ if env is None else env
    return sorted({v for k, v in env.items() if looks_secret(k) and len(v) >= _MIN_VALUE}, key=len, reverse=True)


def redact(text: str, extra: Iterable[str] = (), env: Mapping[str, str] | None = None) -> str:
    """`text` with every secret it could carry masked: the environment's secret values (and `extra` ones),
    values paired with a secret-looking NAME, and credentials inside URLs."""
    text = str(text)
    for value in [*secret_values(env), *(v for v in extra if len(v) >= _MIN_VALUE)]:
        text = text.replace(value, MASK)

    def pair(m: re.Match) -> str:
        if not looks_secret(m["name"]) or m["value"] == MASK:
            return m[0]
        return f"{m['q']}{m['name']}{m['q']}{m['sep']}{m['vq']}{MASK}{m['vq']}"

    text = _PAIR.sub(pair, text)
    for _, shape in _TOKEN_SHAPES:
        text = shape.sub(MASK, text)
    return _URL_USERINFO.sub(lambda m: f"{m['scheme']}{MASK}@", text)


def redact_config(value: Any, key: str = "") -> Any:
    """A config as plain data (`config_to_dict`) with the values of secret keys masked and URL credentials
    masked in every string; the same shape, so it still prints as TOML."""
    if isinstance(value, Mapping):
        return {k: (MASK if secret_key(str(k)) and v not in (None, "") and not isinstance(v, Mapping)
                    else redact_config(v, str(k))) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact_config(v, key) for v in value)
    if isinstance(value, str):
        for _, shape in _TOKEN_SHAPES:
            value = shape.sub(MASK, value)
        return _URL_USERINFO.sub(lambda m: f"{m['scheme']}{MASK}@", value)
    return value
