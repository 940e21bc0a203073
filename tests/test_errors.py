"""The validation vocabulary (voxdiff.errors): each typed check returns the value it accepts and refuses the rest
with ConfigError(key, value, problem, fix) in one line."""

from __future__ import annotations

import math

import pytest

from voxdiff.errors import ConfigError, boolean, int_list, integer, number, one_of


def _refused(check, *args, **kwargs) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        check(*args, **kwargs)
    err = info.value
    assert str(err).count("\n") == 0 and str(err).startswith(f"{args[0]}=") and "Fix: " in str(err)
    return err


def test_integer_accepts_integers_in_range_and_refuses_booleans_floats_and_strings():
    assert integer("a.b", 3, minimum=1) == 3 and integer("a.b", -5) == -5
    assert integer("a.b", 0, minimum=0, maximum=0) == 0
    for bad in (True, 2.0, "2", None, 0):
        err = _refused(integer, "a.b", bad, minimum=1)
        assert err.key == "a.b" and err.value is bad and err.problem == "must be a positive integer"
    assert _refused(integer, "a.b", 7, minimum=0, maximum=4).problem == "must be an integer in [0, 4]"
    assert _refused(integer, "a.b", -1, minimum=0, example=10).fix == "e.g. a.b=10"
    assert _refused(integer, "a.b", -1, minimum=0, fix="use 0").fix == "use 0"


def test_number_bounds_open_and_closed_and_refuses_nan_inf_and_booleans():
    assert number("x", 1) == 1.0 and isinstance(number("x", 1), float)
    assert number("x", 0, lo=0) == 0.0
    assert _refused(number, "x", 0, lo=0, lo_open=True).problem == "must be a positive number"
    assert _refused(number, "x", 1.0, lo=0, hi=1, hi_open=True).problem == "must be a number in [0, 1)"
    assert _refused(number, "x", -0.1, lo=0, example=0.5).fix == "e.g. x=0.5"
    for bad in (math.nan, math.inf, False, "1"):
        _refused(number, "x", bad)


def test_one_of_and_boolean():
    assert one_of("k", "norm", ("norm", "value")) == "norm"
    err = _refused(one_of, "k", "l2", ("norm", "value"))
    assert err.problem == "is not one of norm, value" and err.fix == "use one of norm, value"
    _refused(one_of, "k", True, (1, 2))  # True == 1 in Python; a boolean is not the integer 1 here
    assert boolean("k", False) is False
    for bad in (0, "true", None):
        assert _refused(boolean, "k", bad).problem == "must be true or false"


def test_int_list_length_and_minimum():
    assert int_list("model.channels", [8, 16], length=2) == (8, 16)
    assert _refused(int_list, "model.channels", [8], length=2).problem == "must be a list of 2 positive integers"
    _refused(int_list, "model.channels", [8, True])
    _refused(int_list, "model.channels", [8, 0])
    _refused(int_list, "model.channels", "8,16")
    assert int_list("x", [-1, 0], minimum=None) == (-1, 0)
    assert _refused(int_list, "x", [-1], minimum=0).problem == "must be a list of integers >= 0"
