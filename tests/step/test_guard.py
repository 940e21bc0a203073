"""The non-finite guard: the first bad step recorded on the device without a host read, read by a check, and
``system.guard`` validated."""

from __future__ import annotations

import math

import pytest
import torch

from voxdiff.errors import ConfigError
from voxdiff.step import FiniteGuard, GuardSettings, NonFiniteLossError, guard_settings


@pytest.mark.parametrize("value", [0, -1, 2.5, True, "50"])
def test_check_every_n_steps_must_be_a_positive_integer(value):
    with pytest.raises(ConfigError) as e:
        guard_settings({"check_every_n_steps": value})
    assert e.value.key == "system.guard.check_every_n_steps" and "Fix:" in str(e.value)


def test_guard_settings_defaults_and_unknown_keys():
    assert guard_settings(None) == GuardSettings(1)
    assert guard_settings({"check_every_n_steps": 50}).check_every_n_steps == 50
    with pytest.raises(ConfigError) as e:
        guard_settings({"every": 5})
    assert e.value.key == "system.guard.every"


def test_the_first_bad_step_is_kept_and_read_only_by_a_check(monkeypatch):
    guard = FiniteGuard(GuardSettings(check_every_n_steps=3))
    reads = []
    for name in ("item", "__bool__", "__float__", "tolist", "cpu"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name,
                            lambda t, *a, _o=original, _n=name, **k: reads.append(_n) or _o(t, *a, **k))
    guard.record("loss", torch.tensor(0.5), step=0)
    guard.record("gradient norm", torch.tensor(2.0), step=0)
    guard.record("loss", torch.tensor(0.4), step=1)
    guard.record("gradient norm", torch.tensor(math.inf), step=1)  # the first bad one
    guard.record("loss", torch.tensor(math.nan), step=2)  # later, and not kept
    assert reads == []  # recording is device work only
    assert [guard.due(s) for s in range(6)] == [False, False, True, False, False, True]
    with pytest.raises(NonFiniteLossError, match="the training gradient norm is inf at global step 1") as e:
        guard.check(" (checked before writing a checkpoint)")
    monkeypatch.undo()
    assert (e.value.step, e.value.what, e.value.value) == (1, "gradient norm", math.inf)
    assert "(checked before writing a checkpoint)" in str(e.value)
    guard.reset()
    guard.check()  # nothing recorded since


def test_a_bad_step_on_another_process_stops_this_one_too():
    guard = FiniteGuard(GuardSettings())
    guard.record("loss", torch.tensor(1.0), step=0)
    told = []
    guard.any_rank = lambda bad: told.append(bad) or True  # another rank reports a bad step
    with pytest.raises(NonFiniteLossError, match="on another process") as e:
        guard.check()
    assert told == [False] and e.value.step is None
