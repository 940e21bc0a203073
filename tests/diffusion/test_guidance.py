"""Classifier-free guidance: condition dropout, the null condition, the guided prediction in one batched forward,
and the settings it refuses."""

from __future__ import annotations

import pytest
import torch

from voxdiff.diffusion import DiffusionProcess, diffusion_settings, encode_volume
from voxdiff.diffusion.guidance import (
    autoguided,
    check_guidance_interval,
    check_guidance_scale,
    denoiser,
    drop_condition,
    guidance_settings,
)
from voxdiff.encodings import HaarWavelet, Identity, SpaceToDepth
from voxdiff.errors import ConfigError


def test_dropout_replaces_whole_samples_by_the_null_condition() -> None:
    cond = torch.randn(400, 2, 2, 2, 2) + 5.0  # never zero
    out = drop_condition(cond, 0.25, torch.Generator().manual_seed(0))
    dropped = (out == 0).flatten(1).all(1)
    kept = (out == cond).flatten(1).all(1)
    assert torch.all(dropped ^ kept)  # each sample is either untouched or all null
    assert 0.18 < float(dropped.float().mean()) < 0.32
    assert drop_condition(cond, 0.0) is cond


@pytest.mark.parametrize("encoding", [SpaceToDepth(2), HaarWavelet(), Identity()], ids=["s2d", "haar", "identity"])
def test_no_mask_encodes_to_the_null_condition(encoding) -> None:
    """Masks reach weight-free encodings as {-1, 1}: no encoded voxel of any mask (even an empty or a full one) is
    the all-zero vector of the null condition."""
    g = torch.Generator().manual_seed(0)
    masks = torch.cat([(torch.rand(6, 1, 8, 8, 8, generator=g) > 0.5).float(),
                       torch.zeros(1, 1, 8, 8, 8), torch.ones(1, 1, 8, 8, 8)])
    z = encode_volume(encoding, masks)  # (8, C, d, h, w)
    assert not torch.any(z.abs().amax(dim=1) == 0)


class Counting(torch.nn.Module):
    """A toy conditional model: output = x·w + (the condition's first channels)·v; counts its forward calls."""

    def __init__(self) -> None:
        super().__init__()
        self.calls, self.batches = 0, []

    def forward(self, x, timesteps):
        self.calls += 1
        self.batches.append(x.shape[0])
        c_out = x.shape[1] // 2
        return 0.9 * x[:, :c_out] + 0.5 * x[:, c_out:] + timesteps.float().view(-1, 1, 1, 1, 1) * 1e-3


def test_the_guided_prediction_is_one_batched_forward_of_both_halves() -> None:
    g = torch.Generator().manual_seed(0)
    x, cond = torch.randn(3, 2, 4, 4, 4, generator=g), torch.randn(3, 2, 4, 4, 4, generator=g)
    t = torch.tensor([10, 20, 30])
    model = Counting()
    out = denoiser(model, cond, 2.5)(x, t)
    assert model.calls == 1 and model.batches == [6]
    c = model(torch.cat([x, cond], 1), timesteps=t)
    u = model(torch.cat([x, torch.zeros_like(cond)], 1), timesteps=t)
    torch.testing.assert_close(out, u + 2.5 * (c - u))


def test_guidance_scale_1_is_exactly_the_unguided_sample() -> None:
    """DDIM through the guided sampler at scale 1 against the loop written out with the conditional model alone:
    the same bits, and the unconditional half is never run."""
    process = DiffusionProcess(diffusion_settings({"eta": 1.0}), clip_range=1.0)
    cond = torch.randn(2, 2, 4, 4, 4, generator=torch.Generator().manual_seed(1))
    model = Counting()
    guided = process.sample(model, (2, 2, 4, 4, 4), cond, 5, generator=torch.Generator().manual_seed(0),
                            guidance_scale=1.0)
    assert model.batches == [2] * 5

    g = torch.Generator().manual_seed(0)
    scheduler = process.inference_scheduler
    scheduler.set_timesteps(5)
    x = torch.randn((2, 2, 4, 4, 4), generator=g)
    for t in scheduler.timesteps.tolist():
        out = model(torch.cat([x, cond], 1), timesteps=torch.full((2,), t, dtype=torch.long)).float()
        x, _ = scheduler.step(out, t, x, eta=1.0, generator=g)
    assert torch.equal(guided, x)
    other = process.sample(model, (2, 2, 4, 4, 4), cond, 5, generator=torch.Generator().manual_seed(0),
                           guidance_scale=2.0)
    assert not torch.equal(other, guided)


@pytest.mark.parametrize(("values", "mode", "says"), [
    ({"drop_prob": 1.0}, "bravo", "system.guidance.drop_prob"),
    ({"drop_prob": -0.1}, "bravo", "system.guidance.drop_prob"),
    ({"drop_prob": 0.1}, "seg", "mode=seg"),
    ({"scale": 2.0}, "bravo", "system.guidance.scale"),
])
def test_guidance_settings_are_refused_naming_the_key(values, mode, says) -> None:
    with pytest.raises(ConfigError, match=says):
        guidance_settings(values, mode)


@pytest.mark.parametrize(("scale", "mode", "drop", "says"), [
    (-1.0, "bravo", 0.1, "guidance_scale"),
    (2.0, "seg", 0.0, "mode=seg"),
    (2.0, "bravo", 0.0, "drop_prob=0"),
    ("strong", "bravo", 0.1, "guidance_scale"),
])
def test_a_guidance_scale_that_cannot_work_is_refused(scale, mode, drop, says) -> None:
    with pytest.raises(ConfigError, match=says):
        check_guidance_scale("guidance_scale", scale, mode, drop)
    assert check_guidance_scale("guidance_scale", 1, mode, drop) == 1.0  # no guidance is always fine


def test_autoguidance_pushes_the_prediction_away_from_the_guide_and_scale_1_is_the_model_itself() -> None:
    calls = []

    def model(x, timesteps=None, class_labels=None):
        calls.append(("model", timesteps, class_labels))
        return 2 * x

    def guide(x, timesteps=None, class_labels=None):
        calls.append(("guide", timesteps, class_labels))
        return x.to(torch.bfloat16)  # an autocast output: mixed in float32

    assert autoguided(model, guide, 1.0) is model and autoguided(model, None, 2.0) is model
    x, t, cov = torch.randn(2, 3, 4, 4, 4), torch.tensor([5, 900]), torch.ones(2, 2)
    out = autoguided(model, guide, 1.5)(x, timesteps=t, class_labels=cov)
    bad = x.to(torch.bfloat16).float()
    torch.testing.assert_close(out, bad + 1.5 * (2 * x - bad))
    assert out.dtype == torch.float32
    assert [c[0] for c in calls] == ["model", "guide"] and all(c[1] is t and c[2] is cov for c in calls)


def test_a_guide_equal_to_the_model_changes_no_sample_and_another_guide_does() -> None:
    """Through the real sampler (TrainStep.generate, DDIM): a guide with the model's own weights leaves every sample
    bit for bit as it is, at any scale (guide + s·0); a guide with other weights moves it."""
    import copy

    from voxdiff.encodings.space_to_depth import SpaceToDepth
    from voxdiff.models.unet import build_unet_from_spec, unet_spec
    from voxdiff.step import TrainStep, system_recipe

    torch.manual_seed(0)
    model = build_unet_from_spec(unet_spec(16, 8, [8, 8], [False, False], 1, 8, 4))
    for p in model.parameters():  # MONAI zero-initialises output convs: perturb so that every path carries signal
        p.data.add_(0.05 * torch.randn(p.shape))
    recipe = system_recipe({}, {"decay": 0.9}, {"prediction_type": "sample"})
    step = TrainStep(model, recipe, encoding=SpaceToDepth(2), mode="bravo")
    masks = (torch.rand(2, 1, 8, 8, 8, generator=torch.Generator().manual_seed(1)) > 0.7).float()

    def sample(guide=None, scale=1.0):
        return step.generate(masks, 8, 3, generator=torch.Generator().manual_seed(3), use_ema=False, guide=guide,
                             autoguide_scale=scale)

    plain = sample()
    same = copy.deepcopy(model)
    assert torch.equal(sample(same, 1.7), plain)
    other = copy.deepcopy(model)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.05 * torch.randn(p.shape))
    assert torch.equal(sample(other, 1.0), plain)  # scale 1: the guide is not called
    assert not torch.allclose(sample(other, 1.7), plain, atol=1e-3)


# ------------------------------------------------------------------ the guidance interval (Kynkäänniemi et al. 2024)


def _ddim_times(steps: int) -> list[int]:
    process = DiffusionProcess(diffusion_settings({"eta": 1.0}), clip_range=1.0)
    return process.sampling_timesteps(steps)


def test_the_guidance_interval_guides_only_the_steps_whose_t_over_T_lies_within() -> None:
    """DDIM, 5 steps of 1000 (t = 999, 749, 500, 250, 0): classifier-free guidance in [0, 0.5] runs the doubled
    batch at the last three steps and the conditional half alone at the first two, and the sample is the loop
    written out that way, bit for bit."""
    assert _ddim_times(5) == [999, 749, 500, 250, 0]
    process = DiffusionProcess(diffusion_settings({"eta": 1.0}), clip_range=1.0)
    cond = torch.randn(2, 2, 4, 4, 4, generator=torch.Generator().manual_seed(1))
    model = Counting()
    got = process.sample(model, (2, 2, 4, 4, 4), cond, 5, generator=torch.Generator().manual_seed(0),
                         guidance_scale=2.0, guidance_interval=(0.0, 0.5))
    assert model.batches == [2, 2, 4, 4, 4]

    g = torch.Generator().manual_seed(0)
    scheduler = process.inference_scheduler
    scheduler.set_timesteps(5)
    x = torch.randn((2, 2, 4, 4, 4), generator=g)
    for t in scheduler.timesteps.tolist():
        tt = torch.full((2,), t, dtype=torch.long)
        c = model(torch.cat([x, cond], 1), timesteps=tt).float()
        out = c
        if t / 1000 <= 0.5:
            u = model(torch.cat([x, torch.zeros_like(cond)], 1), timesteps=tt).float()
            out = u + 2.0 * (c - u)
        x, _ = scheduler.step(out, t, x, eta=1.0, generator=g)
    assert torch.equal(got, x)


def test_the_whole_interval_is_bit_for_bit_the_guidance_at_every_step() -> None:
    process = DiffusionProcess(diffusion_settings({"eta": 1.0}), clip_range=1.0)
    cond = torch.randn(2, 2, 4, 4, 4, generator=torch.Generator().manual_seed(1))

    def sample(model, interval):
        return process.sample(model, (2, 2, 4, 4, 4), cond, 5, generator=torch.Generator().manual_seed(0),
                              guidance_scale=2.0, guidance_interval=interval)

    every, whole = Counting(), Counting()
    assert torch.equal(sample(every, None), sample(whole, (0.0, 1.0)))
    assert every.batches == whole.batches == [4] * 5
    assert not torch.equal(sample(Counting(), (0.0, 0.5)), sample(Counting(), None))


def test_autoguidance_in_an_interval_calls_the_guide_only_there() -> None:
    """Rectified flow's Euler steps with autoguidance in [0.5, 1]: the guide runs at the noisy steps only, the model
    at every step; outside the interval the step takes the model's own prediction."""
    from voxdiff.diffusion.rflow import RectifiedFlow, rflow_settings

    process = RectifiedFlow(rflow_settings({"num_inference_steps": 6, "timestep_transform": False}))
    times = process.sampling_timesteps(6, 64)
    inside = [t / 1000 >= 0.5 for t in times]
    assert any(inside) and not all(inside)
    cond = torch.randn(1, 2, 4, 4, 4, generator=torch.Generator().manual_seed(1))
    model, guide = Counting(), Counting()
    guide_scale = torch.nn.Parameter(torch.tensor(0.5))  # a different network: half the output

    def bad(x, timesteps):
        return guide(x, timesteps=timesteps) * guide_scale.detach()

    out = process.sample(autoguided(model, bad, 1.5), (1, 2, 4, 4, 4), cond, 6,
                         generator=torch.Generator().manual_seed(0), guidance_interval=(0.5, 1.0))
    assert model.calls == 6 and guide.calls == sum(inside)
    everywhere = process.sample(autoguided(Counting(), bad, 1.5), (1, 2, 4, 4, 4), cond, 6,
                                generator=torch.Generator().manual_seed(0))
    unguided = process.sample(Counting(), (1, 2, 4, 4, 4), cond, 6, generator=torch.Generator().manual_seed(0))
    assert not torch.equal(out, everywhere) and not torch.equal(out, unguided)


def test_an_interval_that_holds_no_sampling_step_is_refused_naming_the_key() -> None:
    process = DiffusionProcess(diffusion_settings({"eta": 1.0}), clip_range=1.0)
    cond = torch.randn(1, 2, 4, 4, 4)
    with pytest.raises(ConfigError, match=r"guidance_interval=\[0.85, 0.95\]: holds none of the 5 sampling steps "
                                          r"\(t / T from 0.999 down to 0\).*Fix: widen it"):
        process.sample(Counting(), (1, 2, 4, 4, 4), cond, 5, guidance_scale=2.0, guidance_interval=(0.85, 0.95))
    # unguided, an interval is nothing to hold: the plain sampler runs
    process.sample(Counting(), (1, 2, 4, 4, 4), cond, 5, guidance_scale=1.0, guidance_interval=(0.85, 0.95))


@pytest.mark.parametrize("value", [[0.5, 0.2], [0.2, 0.2], [0, 2], [-0.1, 0.5], [0.1], [0, 0.5, 1], "0,0.2",
                                   [True, 0.5], ["a", 1]])
def test_a_guidance_interval_that_is_not_lo_below_hi_within_0_1_is_refused(value) -> None:
    with pytest.raises(ConfigError, match=r"guidance_interval=.*must be \[lo, hi\] with 0 <= lo < hi <= 1.*Fix: "):
        check_guidance_interval("guidance_interval", value)


def test_a_guidance_interval_is_read_as_two_floats_and_null_only_where_allowed() -> None:
    assert check_guidance_interval("k", [0, 0.2]) == (0.0, 0.2)
    assert check_guidance_interval("k", (0.25, 1)) == (0.25, 1.0)
    assert check_guidance_interval("k", None, null=True) is None
    with pytest.raises(ConfigError, match="k=null: must be"):
        check_guidance_interval("k", None)


def test_classifier_free_guidance_of_an_autoguided_model_guides_the_autoguided_predictions() -> None:
    """Both at once: the conditional and unconditional halves each autoguided (guide + w·(model − guide)), then
    mixed as u + s·(c − u); the model and the guide each run once, on the doubled batch."""
    g = torch.Generator().manual_seed(0)
    x, cond = torch.randn(2, 2, 4, 4, 4, generator=g), torch.randn(2, 2, 4, 4, 4, generator=g)
    t = torch.tensor([500, 500])
    model, guide = Counting(), Counting()

    def bad(x, timesteps):
        return 0.5 * guide(x, timesteps=timesteps)

    out = denoiser(autoguided(model, bad, 1.25), cond, 2.0)(x, t)
    assert model.batches == guide.batches == [4]

    def auto(c):
        inp = torch.cat([x, c], 1)
        m, b = model(inp, timesteps=t), bad(inp, timesteps=t)
        return b + 1.25 * (m - b)

    c, u = auto(cond), auto(torch.zeros_like(cond))
    torch.testing.assert_close(out, u + 2.0 * (c - u))
