"""Classifier-free guidance: condition dropout, the null condition, the guided prediction in one batched forward,
and the settings it refuses."""

from __future__ import annotations

import pytest
import torch

from voxdiff.diffusion import DiffusionProcess, diffusion_settings, encode_volume
from voxdiff.diffusion.guidance import check_guidance_scale, denoiser, drop_condition, guidance_settings
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
