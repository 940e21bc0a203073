"""Errors that tell the user what to change.

Every user-facing validation raises :class:`ConfigError` with the config key, the offending value and a fix
that works, so a wrong config is refused before anything launches (STYLE.md, habit 6).
"""

from __future__ import annotations

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
