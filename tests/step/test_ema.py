"""EMA: the update rule, the swap (raw weights restored bit for bit), the state round trip, ``system.ema``."""

import pytest
import torch
from voxdiff.errors import ConfigError
from voxdiff.step import EMA, EMASettings, ema_settings
from voxdiff.step.ema import SAMPLES_PER_HORIZON, auto_interval


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))


def test_update_copies_then_averages():
    m = _model()
    ema = EMA(m, decay=0.9, start_step=1)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(1.0)
    ema.update(m)  # update 1 <= start_step: a copy
    for s, p in zip(ema.shadow, m.parameters()):
        assert torch.equal(s, p)
    before = [s.clone() for s in ema.shadow]
    with torch.no_grad():
        for p in m.parameters():
            p.add_(2.0)
    ema.update(m)  # 0.9 * shadow + 0.1 * param
    for s, b, p in zip(ema.shadow, before, m.parameters()):
        torch.testing.assert_close(s, 0.9 * b + 0.1 * p)
    assert ema.num_updates == 2


def test_swap_uses_the_average_and_restores_raw_weights_exactly():
    m = _model()
    ema = EMA(m, decay=0.5)
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(1.2345).add_(0.1)
    ema.update(m)
    raw = [p.detach().clone() for p in m.parameters()]
    average = [s.clone() for s in ema.shadow]
    x = torch.randn(5, 4)
    with ema.swapped(m):
        for p, s in zip(m.parameters(), average):
            assert torch.equal(p, s)
        y_ema = m(x)
    for p, r in zip(m.parameters(), raw):
        assert torch.equal(p, r)  # bit for bit
    for s, a in zip(ema.shadow, average):
        assert torch.equal(s, a)  # and the average is the average again
    assert not torch.equal(y_ema, m(x))


def test_the_swap_holds_one_parameter_aside_not_a_copy_of_the_model():
    """The weights and the average trade places tensor by tensor: the largest tensor the swap makes is the
    largest parameter (before, it cloned every parameter at once: a whole fp32 copy of the model)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Allocations(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.peak = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten.clone.default:
                self.peak = max(self.peak, out.numel())
            return out

    m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    ema = EMA(m, decay=0.5)
    with Allocations() as seen:
        with ema.swapped(m):
            pass
    assert seen.peak == 64 * 64 == EMA.swap_bytes(m) // 4


def test_swap_restores_after_an_exception():
    m = _model()
    ema = EMA(m)
    with torch.no_grad():
        m[0].weight.add_(1.0)
    raw = m[0].weight.detach().clone()
    try:
        with ema.swapped(m):
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    assert torch.equal(m[0].weight, raw)


def test_state_dict_round_trip():
    m = _model()
    ema = EMA(m, decay=0.99)
    with torch.no_grad():
        m[1].bias.add_(3.0)
    ema.update(m)
    other = EMA(_model(seed=1), decay=0.99)
    other.load_state_dict(ema.state_dict())
    assert other.num_updates == 1
    for a, b in zip(ema.shadow, other.shadow):
        assert torch.equal(a, b)


def test_system_ema_false_means_none_and_null_means_the_defaults():
    assert ema_settings(False) is None
    assert ema_settings(None) == ema_settings(True) == ema_settings({}) == EMASettings()
    assert ema_settings({"decay": 0.9, "start_step": 5}) == EMASettings(0.9, 5, 1)  # auto: a horizon of 10 steps


@pytest.mark.parametrize("decay, k", [(0.9999, 10), (0.999, 10), (0.9995, 10), (0.998, 5), (0.995, 2), (0.99, 1),
                                      (0.95, 1), (0.0, 1)])
def test_auto_interval_keeps_a_hundred_updates_per_horizon(decay, k):
    """``every_n_steps: auto`` (the default) resolves to a number: the longest interval, at most 10, that still
    averages 100 times per horizon ``1 / (1 - decay)``."""
    assert auto_interval(decay) == k
    assert ema_settings({"decay": decay}).every_n_steps == k
    assert ema_settings({"decay": decay, "every_n_steps": "auto"}).every_n_steps == k
    assert ema_settings({"decay": decay, "every_n_steps": 3}).every_n_steps == 3  # a number is kept
    assert EMA(_model(), decay=decay, every_n_steps="auto").every_n_steps == k
    if k > 1:  # the horizon the average spans is at least 100 of its updates
        assert (1 / (1 - decay)) / k >= SAMPLES_PER_HORIZON - 1e-6


@pytest.mark.parametrize("cfg, key", [({"decay": 1.0}, "system.ema.decay"), ({"start_step": -1}, "system.ema.start_step"),
                                      ({"beta": 0.9}, "system.ema.beta"), ("yes", "system.ema")])
def test_bad_ema_settings_name_the_key(cfg, key):
    with pytest.raises(ConfigError) as e:
        ema_settings(cfg)
    assert e.value.key == key


@pytest.mark.parametrize("k", [2, 5])
def test_every_n_steps_keeps_the_horizon(k):
    """Weights that change only at the start of each block of k steps: averaging every k-th step with decay^k
    gives the same average as averaging every step with decay (the horizon is unchanged); in between, the
    k-step average is not touched."""
    every, sparse = _model(), _model()
    a, b = EMA(every, decay=0.9, start_step=k), EMA(sparse, decay=0.9, start_step=k, every_n_steps=k)
    torch.manual_seed(3)
    for block in range(6):
        target = [torch.randn_like(p) for p in every.parameters()]
        for i in range(k):
            for m in (every, sparse):
                with torch.no_grad():
                    for p, t in zip(m.parameters(), target):
                        p.copy_(t)
            before = [s.clone() for s in b.shadow]
            a.update(every)
            b.update(sparse)
            if i < k - 1:
                assert all(torch.equal(x, y) for x, y in zip(before, b.shadow))  # no pass over the weights
        for x, y in zip(a.shadow, b.shadow):
            torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6)
    assert a.num_updates == b.num_updates == 6 * k
    assert not torch.allclose(a.shadow[0], target[0])  # still an average, not a copy
    for bad in (0, "abc", True, 2.5):  # one message for all (it said ">= 0" for "abc", then refused 0 apart)
        with pytest.raises(ConfigError, match=r"system.ema.every_n_steps=.*: must be a positive integer or auto. "
                                              r"Fix: e.g. system.ema.every_n_steps=4, or auto"):
            ema_settings({"every_n_steps": bad})
