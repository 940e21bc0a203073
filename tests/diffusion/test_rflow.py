"""Rectified flow on MONAI's RFlowScheduler: the settings it refuses, its interpolation and velocity target, its
timesteps, and Euler sampling that reaches the data along straight lines."""

from __future__ import annotations

import pytest
import torch

from voxdiff.config import compose, plain
from voxdiff.diffusion import RectifiedFlow, RFlowSettings, build_process, diffusion_settings
from voxdiff.errors import ConfigError


def test_the_config_group_builds_rectified_flow_with_30_steps() -> None:
    cfg = compose("train", ["diffusion=rflow"])
    s = diffusion_settings(plain(cfg.diffusion))
    assert isinstance(s, RFlowSettings) and s.num_inference_steps == 30 and s.prediction_type == "velocity"
    assert isinstance(build_process(s), RectifiedFlow)


@pytest.mark.parametrize(("key", "value", "says"), [
    ("min_snr_gamma", 5.0, "no SNR weighting"),
    ("schedule", "cosine", "no beta schedule"),
    ("eta", 1.0, "no DDIM eta"),
    ("clip_sample", True, "x0 to clip"),
    ("prediction_type", "epsilon", "predicts the velocity"),
    ("timestep_sampling", "gaussian", "is not one of"),
    ("num_inference_steps", 2000, "more Euler steps"),
    ("no_such_setting", 1, "is not a rectified-flow setting"),
])
def test_settings_that_mean_nothing_for_rectified_flow_are_refused_naming_the_key(key, value, says) -> None:
    cfg = plain(compose("train", ["diffusion=rflow"]).diffusion)
    with pytest.raises(ConfigError, match=says) as err:
        diffusion_settings({**cfg, key: value})
    assert err.value.key == f"diffusion.{key}"


def test_the_process_is_an_ordinary_module() -> None:
    """MONAI's RFlowScheduler never initialises nn.Module: kept as a submodule it broke named_modules() (and with it
    Lightning's set-up of a system that holds the process)."""
    p = RectifiedFlow(RFlowSettings())
    holder = torch.nn.Sequential(p)
    assert [type(m).__name__ for m in holder.modules()] == ["Sequential", "RectifiedFlow"]
    holder.to(torch.float64)
    assert p.scheduler.num_train_timesteps == 1000


def test_an_unknown_process_is_refused() -> None:
    with pytest.raises(ConfigError, match="diffusion.process"):
        diffusion_settings({"process": "sde"})


def test_interpolation_and_velocity_target_are_monais() -> None:
    """x_t = (1 − t/T)·x0 + (t/T)·ε; a model that returns x0 − ε has zero loss, one that returns 0 has
    E‖x0 − ε‖²."""
    p = RectifiedFlow(RFlowSettings())
    g = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(2, 3, 4, 4, 4, generator=g), torch.randn(2, 3, 4, 4, 4, generator=g)
    t = torch.tensor([250.0, 750.0])
    x_t = p.scheduler.add_noise(x0, noise, t)
    torch.testing.assert_close(x_t[0], 0.75 * x0[0] + 0.25 * noise[0])
    torch.testing.assert_close(x_t[1], 0.25 * x0[1] + 0.75 * noise[1])

    def oracle(x, timesteps):
        return x0 - noise

    loss, stats = p.loss(oracle, x0, timesteps=t, noise=noise)
    assert float(loss) == 0.0 and torch.equal(stats["timesteps"], t)
    loss0, _ = p.loss(lambda x, timesteps: torch.zeros_like(x), x0, timesteps=t, noise=noise)
    torch.testing.assert_close(loss0, ((x0 - noise) ** 2).mean())


def test_timesteps_follow_the_generator_and_the_resolution_transform() -> None:
    p = RectifiedFlow(RFlowSettings())
    small, large = torch.zeros(4096, 1, 8, 8, 8), torch.zeros(4096, 1, 64, 64, 64)
    a = p.sample_timesteps(small, torch.Generator().manual_seed(0))
    b = p.sample_timesteps(small, torch.Generator().manual_seed(0))
    assert torch.equal(a, b) and a.min() >= 0 and a.max() < 1000
    shifted = p.sample_timesteps(large, torch.Generator().manual_seed(0))  # 64³ > 32³: towards the noise
    assert shifted.mean() > a.mean() + 200
    plain_t = RectifiedFlow(RFlowSettings(timestep_transform=False, timestep_sampling="uniform"))
    u = plain_t.sample_timesteps(small, torch.Generator().manual_seed(0))
    assert abs(float(u.mean()) - 500) < 20  # uniform on [0, T)


@pytest.mark.parametrize("transform", [True, False])
def test_euler_sampling_with_the_exact_velocity_reaches_the_data(transform) -> None:
    """For data concentrated at one point c, the velocity at (x_t, t) is c − ε with ε = (x_t − (1 − t/T)·c)/(t/T):
    the paths are straight, and Euler steps on them land on c whatever the steps."""
    p = RectifiedFlow(RFlowSettings(timestep_transform=transform))
    c = torch.linspace(-1, 1, 2 * 8 * 8 * 8).reshape(1, 2, 8, 8, 8)
    seen = []

    def exact(x, timesteps):
        s = timesteps.float().view(-1, 1, 1, 1, 1) / 1000
        seen.append(float(timesteps[0]))
        eps = (x - (1 - s) * c) / s
        return c - eps

    out = p.sample(exact, (1, 2, 8, 8, 8), num_inference_steps=7, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(out, c, atol=1e-4, rtol=0)
    assert len(seen) == 7 and seen[0] == 1000 and seen == sorted(seen, reverse=True)


def test_rectified_flow_takes_no_eta() -> None:
    p = RectifiedFlow(RFlowSettings())
    with pytest.raises(ValueError, match="eta"):
        p.sample(lambda x, timesteps: x, (1, 1, 4, 4, 4), eta=1.0)
