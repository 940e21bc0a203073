"""The diffusion process against closed forms: schedule, noising, targets, min-SNR weights, loss, DDIM."""

import math

import pytest
import torch
from voxdiff.diffusion import DiffusionProcess, diffusion_settings, min_snr_weight
from voxdiff.errors import ConfigError

T = 1000
B0, B1 = 0.0015, 0.0195


def _alphas_cumprod_closed_form() -> torch.Tensor:
    """scaled_linear_beta in float64: betas = linspace(√β0, √β1, T)², ᾱ = Π(1 − β)."""
    betas = torch.linspace(math.sqrt(B0), math.sqrt(B1), T, dtype=torch.float64) ** 2
    return torch.cumprod(1.0 - betas, dim=0)


def _process(**kw) -> DiffusionProcess:
    return DiffusionProcess(diffusion_settings({"beta_start": B0, "beta_end": B1, **kw}))


def test_schedule_matches_closed_form():
    p = _process()
    ac = _alphas_cumprod_closed_form()
    torch.testing.assert_close(p.alphas_cumprod.double(), ac, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(p.snr.double(), ac / (1 - ac), rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("kind", ["epsilon", "v_prediction", "sample"])
@pytest.mark.parametrize("gamma", [None, 5.0])
def test_min_snr_weights_closed_form(kind, gamma):
    p = _process(prediction_type=kind, min_snr_gamma=gamma)
    ac = _alphas_cumprod_closed_form()
    snr = ac / (1 - ac)
    if gamma is None:
        expected = torch.ones(T, dtype=torch.float64)
    else:
        clipped = torch.minimum(snr, torch.full_like(snr, gamma))
        expected = {"epsilon": clipped / snr, "v_prediction": clipped / (snr + 1), "sample": clipped}[kind]
    torch.testing.assert_close(p.loss_weights.double(), expected, rtol=1e-4, atol=1e-7)
    if gamma is not None:
        # where SNR < γ (late timesteps) the weights are 1 (eps), SNR/(SNR+1) (v), SNR (x0)
        t = T - 1
        assert snr[t] < gamma
        want = {"epsilon": 1.0, "v_prediction": float(snr[t] / (snr[t] + 1)), "sample": float(snr[t])}[kind]
        assert float(p.loss_weights[t]) == pytest.approx(want, rel=1e-4)


def test_min_snr_weight_rejects_unknown_type():
    with pytest.raises(ValueError, match="prediction_type"):
        min_snr_weight(torch.ones(3), "score", 5.0)


@pytest.mark.parametrize("kind", ["epsilon", "v_prediction", "sample"])
def test_noising_and_targets_closed_form(kind):
    p = _process(prediction_type=kind)
    g = torch.Generator().manual_seed(0)
    x0 = torch.rand(3, 8, 2, 4, 4, generator=g) * 2 - 1
    noise = torch.randn(3, 8, 2, 4, 4, generator=g)
    t = torch.tensor([0, 499, 999])
    ac = _alphas_cumprod_closed_form()[t].float().view(3, 1, 1, 1, 1)
    x_t = ac.sqrt() * x0 + (1 - ac).sqrt() * noise
    torch.testing.assert_close(p.add_noise(x0, noise, t), x_t, rtol=1e-5, atol=1e-6)
    expected = {"epsilon": noise, "sample": x0, "v_prediction": ac.sqrt() * noise - (1 - ac).sqrt() * x0}[kind]
    torch.testing.assert_close(p.target(x0, noise, t), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["epsilon", "v_prediction", "sample"])
def test_loss_is_weighted_mse_of_the_target(kind):
    p = _process(prediction_type=kind, min_snr_gamma=5.0)
    g = torch.Generator().manual_seed(1)
    x0 = torch.rand(2, 8, 2, 4, 4, generator=g) * 2 - 1
    cond = torch.rand(2, 8, 2, 4, 4, generator=g)
    noise = torch.randn(2, 8, 2, 4, 4, generator=g)
    t = torch.tensor([10, 900])
    seen = {}

    def model(x, timesteps):
        seen["x"], seen["t"] = x, timesteps
        return 0.3 * x[:, :8]

    loss, stats = p.loss(model, x0, cond, timesteps=t, noise=noise)
    x_t = p.add_noise(x0, noise, t)
    torch.testing.assert_close(seen["x"], torch.cat([x_t, cond], dim=1))  # UNet input = noisy image ⊕ clean mask
    assert torch.equal(seen["t"], t)
    per_sample = ((0.3 * x_t - p.target(x0, noise, t)) ** 2).mean(dim=(1, 2, 3, 4))
    expected = (p.loss_weights[t] * per_sample).mean()
    assert loss.dtype == torch.float32 and loss.dim() == 0
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(stats["mse"], per_sample.mean())


def test_loss_is_fp32_when_the_model_runs_in_bf16():
    p = _process()
    x0 = torch.zeros(1, 8, 2, 4, 4)
    loss, _ = p.loss(lambda x, timesteps: x[:, :8].to(torch.bfloat16), x0, torch.zeros(1, 8, 2, 4, 4))
    assert loss.dtype == torch.float32


def test_loss_seg_mode_has_no_condition_and_checks_shapes():
    p = _process()
    x0 = torch.zeros(2, 8, 2, 4, 4)
    loss, _ = p.loss(lambda x, timesteps: torch.zeros_like(x), x0, None)
    assert torch.isfinite(loss)
    with pytest.raises(ValueError, match="cond"):
        p.loss(lambda x, timesteps: x[:, :8], x0, torch.zeros(2, 8, 2, 4, 2))
    with pytest.raises(ValueError, match="returned"):
        p.loss(lambda x, timesteps: x[:, :4], x0, None)


@pytest.mark.parametrize("cond_channels", [8, 0])
def test_ddim_sample_shape_and_determinism(cond_channels):
    p = _process()
    cond = torch.rand(2, cond_channels, 2, 4, 4) if cond_channels else None
    calls = []

    def model(x, timesteps):
        calls.append(int(timesteps[0]))
        assert x.shape == (2, 8 + cond_channels, 2, 4, 4)
        return 0.1 * x[:, :8]

    a = p.sample(model, (2, 8, 2, 4, 4), cond, num_inference_steps=5, generator=torch.Generator().manual_seed(3))
    b = p.sample(model, (2, 8, 2, 4, 4), cond, num_inference_steps=5, generator=torch.Generator().manual_seed(3))
    assert a.shape == (2, 8, 2, 4, 4) and a.dtype == torch.float32
    assert torch.equal(a, b)
    assert len(calls) == 10 and calls[0] > calls[4]  # 5 steps each, from high noise to low


def test_ddim_with_a_perfect_x0_model_returns_x0():
    """sample-prediction with a model that always predicts x0: deterministic DDIM ends exactly at x0."""
    p = DiffusionProcess(diffusion_settings({"prediction_type": "sample"}), clip_range=1.0)
    x0 = torch.rand(1, 8, 2, 4, 4) * 2 - 1
    out = p.sample(lambda x, timesteps: x0.clone(), tuple(x0.shape), None, num_inference_steps=10)
    torch.testing.assert_close(out, x0, rtol=1e-5, atol=1e-5)


def test_ddim_clips_x0_to_the_encoded_range():
    p = DiffusionProcess(diffusion_settings({"prediction_type": "sample"}), clip_range=1.0)
    out = p.sample(lambda x, timesteps: torch.full_like(x, 7.0), (1, 8, 2, 2, 2), None, num_inference_steps=4)
    torch.testing.assert_close(out, torch.ones_like(out))


@pytest.mark.parametrize(
    "override, key",
    [
        ({"prediction_type": "score"}, "diffusion.prediction_type"),
        ({"schedule": "quadratic"}, "diffusion.schedule"),
        ({"num_inference_steps": 2000}, "diffusion.num_inference_steps"),
        ({"min_snr_gamma": -1.0}, "diffusion.min_snr_gamma"),
        ({"beta_end": 0.001}, "diffusion.beta_end"),
        ({"typo": 1}, "diffusion.typo"),
        ({"num_train_timesteps": 0}, "diffusion.num_train_timesteps"),
    ],
)
def test_settings_refuse_bad_values(override, key):
    with pytest.raises(ConfigError) as e:
        diffusion_settings(override)
    assert e.value.key == key
    assert "Fix:" in str(e.value)


def test_cosine_schedule_builds():
    p = _process(schedule="cosine")
    assert p.alphas_cumprod[0] > 0.99 and p.alphas_cumprod[-1] < 1e-3


@pytest.mark.parametrize("kind", ["epsilon", "v_prediction", "sample"])
def test_an_output_and_the_x0_it_predicts_convert_both_ways(kind):
    """to_x0 and from_x0 invert each other at every timestep, and to_x0 of the true target is the true x0 (what a
    sampler's x0 map relies on)."""
    process = DiffusionProcess(diffusion_settings({"prediction_type": kind}))
    g = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(2, 3, 4, 4, 4, generator=g), torch.randn(2, 3, 4, 4, 4, generator=g)
    for t in (0, 37, 500, 999):
        ts = torch.full((2,), t)
        x = process.add_noise(x0, noise, ts)
        target = process.target(x0, noise, ts)
        torch.testing.assert_close(process.to_x0(target, x, t), x0, atol=1e-3, rtol=1e-3)
        torch.testing.assert_close(process.from_x0(process.to_x0(target, x, t), x, t), target, atol=1e-3, rtol=1e-3)
    assert (process.timestep_at(0.05), process.timestep_at(0), process.timestep_at(1)) == (50, 0, 999)
