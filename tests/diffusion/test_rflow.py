"""Rectified flow on MONAI's RFlowScheduler: the settings it refuses, its interpolation and velocity target (predicted
as the velocity or as x0), its timesteps, Euler sampling that reaches the data along straight lines, and the
stochastic steps (eta) that keep the data's distribution."""

from __future__ import annotations

import pytest
import torch

from voxdiff.config import compose, plain
from voxdiff.diffusion import RectifiedFlow, RFlowSettings, build_process, diffusion_settings
from voxdiff.diffusion.rflow import flow_step
from voxdiff.errors import ConfigError


def test_the_config_group_builds_rectified_flow_with_30_steps() -> None:
    cfg = compose("train", ["diffusion=rflow"])
    s = diffusion_settings(plain(cfg.diffusion))
    assert isinstance(s, RFlowSettings) and s.num_inference_steps == 30 and s.prediction_type == "velocity"
    assert isinstance(build_process(s), RectifiedFlow)


@pytest.mark.parametrize(("key", "value", "says"), [
    ("min_snr_gamma", 5.0, "no SNR weighting"),
    ("schedule", "cosine", "no beta schedule"),
    ("eta", 1.5, r"in \[0, 1\]"),
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


def test_an_eta_outside_0_to_1_is_refused_and_a_run_configured_without_one_samples_deterministically() -> None:
    p = RectifiedFlow(RFlowSettings())
    with pytest.raises(ValueError, match="eta=1.5"):
        p.sample(lambda x, timesteps: x, (1, 1, 4, 4, 4), eta=1.5)
    old = plain(compose("train", ["diffusion=rflow"]).diffusion)
    assert diffusion_settings({**old, "eta": None}).eta == 0.0  # checkpoints of runs from before rflow took an eta


def _exact_gaussian(prediction_type: str, sd: float):
    """The exact prediction for data drawn from N(0, sd²) per element, E[x0 | x_s] = (1 − s)·sd²·x_s/((1 − s)²·sd² +
    s²), as x0 (``sample``) or as the velocity x0 − ε (``velocity``)."""
    def model(x, timesteps):
        s = timesteps.float().view(-1, 1, 1, 1, 1) / 1000
        x0 = (1 - s) * sd ** 2 / ((1 - s) ** 2 * sd ** 2 + s ** 2) * x
        return x0 if prediction_type == "sample" else x0 - (x - (1 - s) * x0) / s
    return model


@pytest.mark.parametrize("prediction_type", ["velocity", "sample"])
@pytest.mark.parametrize("eta", [0.0, 1.0])
def test_sampling_with_the_exact_prediction_draws_the_datas_spread(prediction_type, eta) -> None:
    """With the exact denoiser of Gaussian data, many steps draw samples of the data's spread, deterministic or
    ancestral (a step that injected the whole s' of fresh noise instead of the posterior's spread draws 0.35)."""
    p = RectifiedFlow(RFlowSettings(prediction_type=prediction_type, timestep_transform=False))
    out = p.sample(_exact_gaussian(prediction_type, 0.5), (2, 1, 16, 16, 16), num_inference_steps=500, eta=eta,
                   generator=torch.Generator().manual_seed(0))
    assert float(out.std()) == pytest.approx(0.5, rel=0.02)


def test_the_two_predictions_sample_alike_and_eta_0_is_monais_euler_step() -> None:
    """x-prediction converted to its velocity takes the same steps as velocity prediction; eta = 0 is the Euler step
    ``x + v·(t − t')/T`` (MONAI's), eta > 0 draws other samples from the same start."""
    shape, g = (1, 1, 8, 8, 8), lambda: torch.Generator().manual_seed(3)
    v = RectifiedFlow(RFlowSettings()).sample(_exact_gaussian("velocity", 0.5), shape, num_inference_steps=6,
                                              generator=g())
    x = RectifiedFlow(RFlowSettings(prediction_type="sample")).sample(_exact_gaussian("sample", 0.5), shape,
                                                                      num_inference_steps=6, generator=g())
    torch.testing.assert_close(v, x, atol=1e-5, rtol=0)
    p = RectifiedFlow(RFlowSettings(eta=0.5))
    assert not torch.allclose(p.sample(_exact_gaussian("velocity", 0.5), shape, num_inference_steps=6, generator=g()),
                              v, atol=1e-3)
    z = torch.randn(shape, generator=g())
    euler = flow_step(torch.ones(shape), z, 0.5, 0.3, eta=0.0)
    torch.testing.assert_close(euler, z + 0.2)
    torch.testing.assert_close(flow_step(torch.ones(shape), z, 0.5, 0.0, eta=1.0), z + 0.5)  # s' = 0: x̂0


def test_x_prediction_is_trained_on_its_velocity_held_near_the_data() -> None:
    """An x0-predicting UNet that returns x0 has zero loss; one that returns 0 has ‖x0‖²/s² with s held at 0.05."""
    p = RectifiedFlow(RFlowSettings(prediction_type="sample"))
    g = torch.Generator().manual_seed(1)
    x0, noise = torch.randn(3, 2, 4, 4, 4, generator=g), torch.randn(3, 2, 4, 4, 4, generator=g)
    t = torch.tensor([0.0, 20.0, 500.0])  # s = 0 and 0.02 (held at 0.05), 0.5

    def oracle(x, timesteps):
        return x0

    assert float(p.loss(oracle, x0, timesteps=t, noise=noise)[0]) == 0.0
    loss, stats = p.loss(lambda x, timesteps: torch.zeros_like(x), x0, timesteps=t, noise=noise)
    per_sample = (x0 ** 2).mean(dim=(1, 2, 3, 4)) / torch.tensor([0.05, 0.05, 0.5]) ** 2
    torch.testing.assert_close(loss, per_sample.mean())
    torch.testing.assert_close(stats["mse"], per_sample.mean())
    # where s >= 0.05 that is the MSE of its velocity (x̂0 − x_t)/s against x0 − noise
    x_t = 0.5 * x0[2] + 0.5 * noise[2]
    torch.testing.assert_close(per_sample[2], (((0 - x_t) / 0.5 - (x0[2] - noise[2])) ** 2).mean())


@pytest.mark.parametrize("kind", ["velocity", "sample"])
def test_the_x0_an_output_predicts(kind):
    """to_x0 of the true target (the velocity x0 − ε, or x0) is x0 on the path x_t = (1 − s)·x0 + s·ε."""
    flow = RectifiedFlow(diffusion_settings({"process": "rflow", "prediction_type": kind}))
    g = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(2, 3, 4, 4, 4, generator=g), torch.randn(2, 3, 4, 4, 4, generator=g)
    for t in (10.0, 500.0, 990.0):
        x = flow.add_noise(x0, noise, torch.full((2,), t))
        torch.testing.assert_close(flow.to_x0(x0 - noise if kind == "velocity" else x0, x, t), x0)
    assert (flow.timestep_at(0.05), flow.timestep_at(2.0)) == (50.0, 1000.0)


def test_preconditioned_x_prediction_makes_a_zero_output_the_exact_denoiser_of_data_of_its_rms() -> None:
    """With ``sigma_data`` (EDM's preconditioning), x̂₀ = c_skip·x_t + c_out·F, and c_skip·x_t is E[x₀ | x_t] for
    Gaussian data of RMS sigma_data: a UNet returning 0 is then the exact denoiser. Its x̂₀ is the identity near the
    data (where a plain x-predicting UNet returning 0 predicts 0) and sampling with it draws the data's spread."""
    sd = 0.5
    p = RectifiedFlow(diffusion_settings({"process": "rflow", "prediction_type": "sample", "sigma_data": sd,
                                          "timestep_transform": False}))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 1, 4, 4, 4, generator=g)
    zero = torch.zeros_like(x)
    for t in (5.0, 300.0, 1000.0):
        torch.testing.assert_close(p.to_x0(zero, x, t), _exact_gaussian("sample", sd)(x, torch.full((2,), t)))
    x0 = torch.randn(2, 1, 4, 4, 4, generator=g)
    near = p.add_noise(x0, torch.randn(x0.shape, generator=g), torch.full((2,), 5.0))  # 0.5% of the path
    assert float((p.to_x0(zero, near, 5.0) - x0).abs().max()) < 0.05 * float(x0.abs().max())
    plain_x = RectifiedFlow(RFlowSettings(prediction_type="sample"))
    assert torch.equal(plain_x.to_x0(zero, near, 5.0), zero)
    out = p.sample(lambda x, timesteps: torch.zeros_like(x), (2, 1, 16, 16, 16), num_inference_steps=500,
                   generator=torch.Generator().manual_seed(0))
    assert float(out.std()) == pytest.approx(sd, rel=0.02)


@pytest.mark.parametrize("sd", [(1.0,), (2.8, 0.02)], ids=["one RMS", "one per channel"])
def test_the_preconditioned_target_has_unit_rms_and_the_loss_stays_the_velocity_mse(sd) -> None:
    """c_skip → 1 and c_out → 0 near the data, (0, sigma_data) at pure noise; the UNet's target (x₀ − c_skip·x_t)/c_out
    has unit RMS in each channel at every noise level for data of those RMSs (a Haar encoding's bands differ by 100×);
    and the loss of any output is the MSE of the velocity (x̂₀ − x_t)/s it implies against x₀ − ε, finite at t = 0."""
    from voxdiff.diffusion.rflow import skip_coefficients

    c_skip, c_out = skip_coefficients(torch.tensor([0.0, 0.5, 1.0]), sd, 2)  # (3, 2, 1, 1, 1)
    torch.testing.assert_close(c_skip[0].flatten(), torch.ones(2), atol=2e-3, rtol=0)
    torch.testing.assert_close(c_out[0].flatten(), torch.zeros(2), atol=3e-3, rtol=0)
    assert c_skip[2].flatten().tolist() == [0.0, 0.0]
    torch.testing.assert_close(c_out[2].flatten(), torch.tensor(sd).expand(2))
    g = torch.Generator().manual_seed(2)
    x0 = torch.randn(4, 2, 16, 16, 16, generator=g) * torch.tensor(sd).expand(2).view(1, 2, 1, 1, 1)
    noise = torch.randn(4, 2, 16, 16, 16, generator=g)
    p = RectifiedFlow(diffusion_settings({"process": "rflow", "prediction_type": "sample", "sigma_data": list(sd)}))
    t = torch.tensor([10.0, 300.0, 700.0, 999.0])
    skip, out = skip_coefficients(t / 1000, sd, 2)
    x_t = p.add_noise(x0, noise, t)
    target = (x0 - skip * x_t) / out
    torch.testing.assert_close(target.pow(2).mean(dim=(2, 3, 4)).sqrt(), torch.ones(4, 2), atol=0.05, rtol=0)
    f = torch.randn(x0.shape, generator=g)
    loss, stats = p.loss(lambda x, timesteps: f, x0, timesteps=t, noise=noise)
    s = (t / 1000).view(-1, 1, 1, 1, 1)
    velocity_mse = (((skip * x_t + out * f - x_t) / s - (x0 - noise)) ** 2).mean()
    torch.testing.assert_close(loss, velocity_mse, rtol=1e-4, atol=0)
    torch.testing.assert_close(stats["mse"], velocity_mse, rtol=1e-4, atol=0)
    at_zero, _ = p.loss(lambda x, timesteps: f, x0, timesteps=torch.zeros(4), noise=noise)
    assert torch.isfinite(at_zero)


@pytest.mark.parametrize(("values", "says"), [
    ({"sigma_data": 1.0}, "prediction_type=sample"),  # the default velocity prediction
    ({"prediction_type": "sample", "sigma_data": 0}, "in (0, 100]"),
    ({"prediction_type": "sample", "sigma_data": "one"}, "in (0, 100]"),
    ({"prediction_type": "sample", "sigma_data": [1.0, -0.1]}, "=-0.1"),
    ({"prediction_type": "sample", "sigma_data": []}, "one per encoding channel"),
])
def test_a_preconditioning_that_cannot_work_is_refused_naming_the_key(values, says) -> None:
    with pytest.raises(ConfigError, match="diffusion.sigma_data") as e:
        diffusion_settings({"process": "rflow", **values})
    assert says in str(e.value)


def test_a_centred_preconditioning_makes_a_zero_output_the_exact_denoiser_of_data_of_that_mean_and_spread() -> None:
    """With ``data_mean`` μ the skip acts on the centred path x_t − (1 − s)·μ: for Gaussian data N(μ, σ²) per channel
    a UNet returning 0 is the exact denoiser μ + c_skip·(x_t − (1 − s)·μ), and sampling with it draws the data's mean
    and spread in each channel. Without the mean (EDM's coefficients alone) the same zero output pulls x̂₀ towards 0,
    so its samples have a mean of 0, not μ."""
    mean, sd = (-2.8, 0.5), (0.2, 0.05)
    settings = {"process": "rflow", "prediction_type": "sample", "timestep_transform": False, "sigma_data": list(sd)}
    p = RectifiedFlow(diffusion_settings({**settings, "data_mean": list(mean)}))
    mu, sigma = torch.tensor(mean).view(1, 2, 1, 1, 1), torch.tensor(sd).view(1, 2, 1, 1, 1)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 2, 4, 4, 4, generator=g)
    zero = torch.zeros_like(x)
    for t in (5.0, 300.0, 1000.0):
        s = t / 1000
        exact = mu + (1 - s) * sigma ** 2 / ((1 - s) ** 2 * sigma ** 2 + s ** 2) * (x - (1 - s) * mu)
        torch.testing.assert_close(p.to_x0(zero, x, t), exact)
    out = p.sample(lambda x, timesteps: torch.zeros_like(x), (2, 2, 16, 16, 16), num_inference_steps=500,
                   generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(out.mean(dim=(0, 2, 3, 4)), torch.tensor(mean), atol=0.02, rtol=0)
    torch.testing.assert_close(out.std(dim=(0, 2, 3, 4)), torch.tensor(sd), atol=0, rtol=0.03)
    uncentred = RectifiedFlow(diffusion_settings(settings)).sample(
        lambda x, timesteps: torch.zeros_like(x), (2, 2, 16, 16, 16), num_inference_steps=500,
        generator=torch.Generator().manual_seed(0))
    assert float(uncentred[:, 0].mean().abs()) < 0.05


def test_the_centred_target_has_unit_rms_and_a_zero_mean_changes_nothing() -> None:
    """For data of mean μ and spread σ per channel (a Haar mask's LL band: −2.83 with a spread of a tenth), the UNet's
    target (x₀ − μ − c_skip·(x_t − (1 − s)·μ))/c_out has unit RMS at every noise level, where uncentred it grows
    to |μ|/σ; the loss is still the velocity's MSE; and ``data_mean`` 0 gives the loss of no ``data_mean``, bit for
    bit."""
    from voxdiff.diffusion.rflow import skip_coefficients

    mean, sd = torch.tensor([-2.83, 0.0]).view(1, 2, 1, 1, 1), (0.1, 0.03)
    g = torch.Generator().manual_seed(4)
    x0 = mean + torch.randn(4, 2, 16, 16, 16, generator=g) * torch.tensor(sd).view(1, 2, 1, 1, 1)
    noise = torch.randn(x0.shape, generator=g)
    settings = {"process": "rflow", "prediction_type": "sample", "sigma_data": list(sd)}
    p = RectifiedFlow(diffusion_settings({**settings, "data_mean": [-2.83, 0.0]}))
    t = torch.tensor([10.0, 300.0, 700.0, 999.0])
    s = (t / 1000).view(-1, 1, 1, 1, 1)
    skip, out = skip_coefficients(t / 1000, sd, 2)
    x_t = p.add_noise(x0, noise, t)
    target = (x0 - mean - skip * (x_t - (1 - s) * mean)) / out
    torch.testing.assert_close(target.pow(2).mean(dim=(2, 3, 4)).sqrt(), torch.ones(4, 2), atol=0.05, rtol=0)
    uncentred = (x0 - skip * x_t) / out
    assert float(uncentred[:, 0].pow(2).mean().sqrt()) > 10
    f = torch.randn(x0.shape, generator=g)
    loss, stats = p.loss(lambda x, timesteps: f, x0, timesteps=t, noise=noise)
    velocity_mses = [((p.to_x0(f[i:i + 1], x_t[i:i + 1], float(t[i])) - x_t[i:i + 1]) / float(s[i])
                      - (x0[i:i + 1] - noise[i:i + 1])).pow(2).mean() for i in range(4)]  # (x̂₀ − x_t)/s − v
    torch.testing.assert_close(loss, torch.stack(velocity_mses).mean(), rtol=1e-4, atol=0)
    torch.testing.assert_close(stats["mse"], loss, rtol=1e-4, atol=0)
    plain_loss, _ = RectifiedFlow(diffusion_settings(settings)).loss(lambda x, timesteps: f, x0, timesteps=t,
                                                                    noise=noise)
    zero_loss, _ = RectifiedFlow(diffusion_settings({**settings, "data_mean": 0})).loss(
        lambda x, timesteps: f, x0, timesteps=t, noise=noise)
    assert torch.equal(zero_loss, plain_loss)


@pytest.mark.parametrize(("values", "says"), [
    ({"prediction_type": "sample", "data_mean": -2.8}, "diffusion.sigma_data is null"),
    ({"prediction_type": "sample", "sigma_data": 0.1, "data_mean": "low"}, "in [-100, 100]"),
    ({"prediction_type": "sample", "sigma_data": 0.1, "data_mean": [0.0, 1e9]}, "=1000000000"),
    ({"prediction_type": "sample", "sigma_data": 0.1, "data_mean": []}, "one per encoding channel"),
])
def test_a_data_mean_that_cannot_work_is_refused_naming_the_key(values, says) -> None:
    with pytest.raises(ConfigError, match="diffusion.data_mean") as e:
        diffusion_settings({"process": "rflow", **values})
    assert says in str(e.value)


def test_one_rms_per_channel_must_match_the_encodings_channels() -> None:
    p = RectifiedFlow(diffusion_settings({"process": "rflow", "prediction_type": "sample", "sigma_data": [1, 1, 1]}))
    x0 = torch.zeros(1, 2, 4, 4, 4)
    with pytest.raises(ValueError, match="3 values for an encoding of 2 channels"):
        p.loss(lambda x, timesteps: x, x0, timesteps=torch.tensor([500.0]))
    centred = RectifiedFlow(diffusion_settings({"process": "rflow", "prediction_type": "sample", "sigma_data": 1,
                                                "data_mean": [0, 0, 0]}))
    with pytest.raises(ValueError, match="diffusion.data_mean has 3 values for an encoding of 2 channels"):
        centred.to_x0(x0, x0, 500.0)


def test_encoding_stats_prints_a_centred_preconditioning_the_run_accepts(capsys) -> None:
    """``scripts/encoding_stats.py`` measures the demo mask model's Haar distance maps over its training split: the
    low-pass band is the background's −1·√8 with lesions a few per cent of it (spread ≪ RMS), the detail bands have
    mean ≈ 0 (spread = RMS); the line it prints composes to a run the spec accepts, and that run's process is
    centred with those values."""
    from script_modules import load_script

    from voxdiff.config import compose
    from voxdiff.run.spec import run_spec_problems

    script = load_script("scripts/encoding_stats.py")
    base = ["experiment=demo_seg", "data.num_subjects=6"]
    moments = script.measure(base)
    assert len(moments["mean"]) == 8
    assert -2.83 < moments["mean"][0] < -2.6 and moments["spread"][0] < 0.2 * moments["rms"][0]
    assert all(abs(m) < 0.2 * r for m, r in zip(moments["mean"][1:], moments["rms"][1:]))
    script.main(base)
    line = capsys.readouterr().out.splitlines()[-1]
    overrides = [part.strip("'") for part in line.split(": ", 1)[1].split()]
    assert [o.split("=")[0] for o in overrides] == ["diffusion.data_mean", "diffusion.sigma_data"]
    spec, problems = run_spec_problems(compose("train", [*base, *overrides]))
    assert problems == []
    settings = spec.system.recipe.diffusion
    assert settings.data_mean[0] == pytest.approx(moments["mean"][0], rel=1e-3)
    assert settings.sigma_data[3] == pytest.approx(moments["spread"][3], rel=1e-3)
