"""Config errors and the `require` check used by every config section's `validate()`.

Deliberately free of moerl and torch imports, so that torch-free config modules (`moerl.config`,
`moerl.train.config`) can share it without import cycles.
"""

from __future__ import annotations

__all__ = ["CheckFailed", "ConfigError", "require"]


class ConfigError(ValueError):
    """A config that cannot be loaded: bad file, unknown key, wrong type or a failed check."""


class CheckFailed(ConfigError):
    """Raised by `require` inside `validate()`; the loader prefixes the key with its section."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"config key {key!r} {message}")
        self.key, self.message = key, message


def require(condition: bool, key: str, message: str) -> None:
    """A check for `validate()`: `key` is the field's name relative to the section being validated."""
    if not condition:
        raise CheckFailed(key, message)
