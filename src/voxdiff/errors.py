"""Errors that tell the user what to change.

Every user-facing validation raises :class:`ConfigError` with the config key, the offending value and a fix
that works, so a wrong config is refused before anything launches (STYLE.md, habit 6).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class ConfigError(ValueError):
    """A configuration value that cannot work.

    Args:
        key: the dotted config key, as a user would override it (``model.channels``).
        value: the offending value.
        problem: what is wrong with it, in one sentence.
        fix: a change that works, in one sentence.
    """

    def __init__(self, key: str, value: Any, problem: str, fix: str) -> None:
        self.key = key
        self.value = value
        self.problem = problem
        self.fix = fix
        super().__init__(f"{key}={show_value(value)}: {problem}. Fix: {fix}")


def show_value(value: Any) -> str:
    """A config value as messages show it: ``[8, 8, 16]``, ``true``, ``null``."""
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(show_value(v) for v in value) + "]"
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return "null"
    return str(value)


def settings_from(cls: type, key: str, values: Mapping[str, Any] | None) -> Any:
    """The dataclass ``cls`` from a plain config mapping, refusing keys it does not have.

    Args:
        cls: a dataclass of settings with defaults.
        key: the config key of the mapping (``system.ema``), for the error.
        values: the mapping (None: all defaults).

    Raises:
        ConfigError: ``<key>.<unknown>``, its value and the settings that exist.
    """
    values = dict(values or {})
    known = set(cls.__dataclass_fields__)
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"{key}.{unknown[0]}", values[unknown[0]], f"is not a {key} setting",
                          f"remove it; the settings are {', '.join(sorted(known))}")
    return cls(**values)


def require_nonneg_int(key: str, value: Any, example: str) -> None:
    """Refuse anything but an integer >= 0 (booleans included), with ``key=example`` as the fix."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(key, value, "must be an integer >= 0", f"e.g. {key}={example}")
