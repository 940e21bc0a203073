"""Errors that tell the user what to change.

Every user-facing validation raises :class:`ConfigError` with the config key, the offending value and a fix
that works, so a wrong config is refused before anything launches (STYLE.md, habit 6).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

T = TypeVar("T")


def plain(value: Any) -> Any:
    """A config node (OmegaConf's ``DictConfig``/``ListConfig``, as Hydra passes them with ``_recursive_: false``)
    as plain Python containers, resolved; anything else unchanged. The checks below take plain values."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


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


class ConfigErrors(ConfigError):
    """Several configuration problems found in one pass (:func:`voxdiff.run.spec.run_spec`).

    ``key``, ``value``, ``problem`` and ``fix`` are the first problem's; the message names every problem, one line
    each; ``problems`` holds them all.
    """

    def __init__(self, problems: Iterable[ConfigError]) -> None:
        self.problems = tuple(problems)
        if not self.problems:
            raise ValueError("ConfigErrors needs at least one problem")
        first = self.problems[0]
        super().__init__(first.key, first.value, first.problem, first.fix)
        self.args = ("\n".join(str(p) for p in self.problems),)


class Problems:
    """The problems of one validation pass: ``problems(check)`` runs ``check`` and keeps the :class:`ConfigError` it
    raises (returning None; one per key and value), else returns its result; ``problems.raise_all()`` raises what
    was kept."""

    def __init__(self, found: Iterable[ConfigError] = ()) -> None:
        self.found: list[ConfigError] = list(found)

    def __call__(self, check: Callable[[], T]) -> T | None:
        try:
            return check()
        except ConfigError as err:  # several problems of one check count one by one
            for problem in err.problems if isinstance(err, ConfigErrors) else [err]:
                # a value two checks refuse (trainer.gradient_clip_val: the trainer's keys, the step's clipping) is
                # named once, by the first
                if not any(p.key == problem.key and p.value == problem.value for p in self.found):
                    self.found.append(problem)
            return None

    def raise_all(self) -> None:
        raise_all(self.found)


def raise_all(problems: Iterable[ConfigError]) -> None:
    """Raise nothing for no problem, the problem itself for one, :class:`ConfigErrors` for several."""
    problems = list(problems)
    if len(problems) == 1:
        raise problems[0]
    if problems:
        raise ConfigErrors(problems)


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


# ------------------------------------------------------------------------------------ the validation vocabulary
# Typed field checks that every settings object uses: each returns the checked value or raises ConfigError naming
# the key, the value, the problem and a fix (``fix``, else ``e.g. key=<example>``). Booleans are never numbers.


def _fix(key: str, fix: str | None, example: Any) -> str:
    return fix if fix is not None else f"e.g. {key}={show_value(example)}"


def _range(lo: float | None, hi: float | None, lo_open: bool, hi_open: bool) -> str:
    if lo is not None and hi is not None:
        return f"in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
    if lo is not None:
        return f"{'>' if lo_open else '>='} {lo}"
    return f"{'<' if hi_open else '<='} {hi}"


def integer(key: str, value: Any, *, minimum: int | None = None, maximum: int | None = None, example: Any = None,
            fix: str | None = None) -> int:
    """``value`` if it is an integer within ``[minimum, maximum]``; a positive integer is ``minimum=1``."""
    ok = isinstance(value, int) and not isinstance(value, bool)
    if not ok or (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        bound = "" if minimum is None and maximum is None else " " + _range(minimum, maximum, False, False)
        what = "a positive integer" if (minimum, maximum) == (1, None) else f"an integer{bound}"
        raise ConfigError(key, value, f"must be {what}", _fix(key, fix, example if example is not None
                                                                else max(minimum or 0, 1)))
    return value


def number(key: str, value: Any, *, lo: float | None = None, hi: float | None = None, lo_open: bool = False,
           hi_open: bool = False, example: Any = None, fix: str | None = None) -> float:
    """``value`` as a float if it is a finite number within the bounds (``lo_open``/``hi_open``: the bound
    excluded)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if ok:
        v = float(value)
        ok = math.isfinite(v) and (lo is None or (v > lo if lo_open else v >= lo)) and (
            hi is None or (v < hi if hi_open else v <= hi))
    if not ok:
        if (lo, lo_open, hi) == (0, True, None):
            what = "a positive number"
        else:
            what = "a number" + ("" if lo is None and hi is None else " " + _range(lo, hi, lo_open, hi_open))
        raise ConfigError(key, value, f"must be {what}", _fix(key, fix, example))
    return float(value)


def one_of(key: str, value: Any, choices: Iterable[Any], fix: str | None = None) -> Any:
    """``value`` if it is one of ``choices``."""
    choices = list(choices)
    if isinstance(value, bool) and not any(isinstance(c, bool) for c in choices) or value not in choices:
        raise ConfigError(key, value, f"is not one of {', '.join(show_value(c) for c in choices)}",
                          fix if fix is not None else f"use one of {', '.join(show_value(c) for c in choices)}")
    return value


def boolean(key: str, value: Any, fix: str | None = None) -> bool:
    """``value`` if it is ``true`` or ``false`` (not 0/1, not a string)."""
    if not isinstance(value, bool):
        raise ConfigError(key, value, "must be true or false", fix if fix is not None else f"e.g. {key}=true")
    return value


def int_list(key: str, value: Any, *, length: int | None = None, minimum: int | None = 1, example: Any = None,
             fix: str | None = None) -> tuple[int, ...]:
    """``value`` as a tuple of integers >= ``minimum``, of ``length`` entries when given."""
    items = list(value) if isinstance(value, (list, tuple)) else None
    ok = items is not None and (length is None or len(items) == length) and all(
        isinstance(v, int) and not isinstance(v, bool) and (minimum is None or v >= minimum) for v in items)
    if not ok:
        count = f"{length} " if length is not None else ""
        what = "positive integers" if minimum == 1 else "integers" + (f" >= {minimum}" if minimum is not None else "")
        raise ConfigError(key, value, f"must be a list of {count}{what}", _fix(key, fix, example))
    return tuple(items)
