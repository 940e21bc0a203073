"""Does the generated image obey a covariate? A tiny task on the CPU whose anatomy is set by one covariate: a dark
central sphere (a ventricle) whose radius grows with ``c`` in [0, 1] (2 + 4c voxels in a 16³ volume), as the
phantom's ventricles grow with age. The real :class:`TrainStep` trains the UNet with its covariate embedding
(:mod:`voxdiff.models.covariates`) and joint condition dropout, then samples at eight requested values it never saw.

The figure is the *effect* reproduced: the slope of the generated sphere's size (dark voxels) against the requested
``c``, over the slope of the real volumes'. A model that learned the covariate reaches at least :data:`OBEYS`. The
negative control trains the same model on the same volumes with covariates drawn independently of them: nothing
ties the covariate to the anatomy, and the same figure must stay below the threshold.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from voxdiff.diffusion import build_process, diffusion_settings, encoded_range
from voxdiff.encodings.space_to_depth import SpaceToDepth
from voxdiff.models.unet import build_unet_from_spec, unet_spec
from voxdiff.step import TrainStep, system_recipe

SIZE, BATCH, STEPS = 16, 6, 60
OBEYS = 0.5  # half the real effect at least
DDPM_X0 = {"prediction_type": "sample"}

pytestmark = pytest.mark.slow


def volumes(c: torch.Tensor) -> torch.Tensor:
    """``(n, 1, S, S, S)`` images: 0.75 outside a centred sphere of radius ``2 + 4c``, 0.15 inside."""
    axis = torch.arange(SIZE, dtype=torch.float32) - (SIZE - 1) / 2
    z, y, x = torch.meshgrid(axis, axis, axis, indexing="ij")
    inside = ((z**2 + y**2 + x**2).sqrt()[None] <= (2.0 + 4.0 * c)[:, None, None, None]).float()
    return (0.75 - 0.6 * inside)[:, None]


def encoded(c: torch.Tensor) -> torch.Tensor:
    """``(n, 2)``: ``c`` normalised (uniform: mean 0.5, std 0.29) and the presence entry, as the data module does."""
    return torch.stack([(c - 0.5) / 0.29, torch.ones_like(c)], dim=1)


def dark(v: torch.Tensor) -> torch.Tensor:
    return (v < 0.45).flatten(1).sum(1).float()


def trained_step(independent: bool = False, drop_prob: float = 0.2) -> TrainStep:
    torch.manual_seed(0)
    encoding = SpaceToDepth(2)
    spec = replace(unet_spec(16, 8, [32, 32, 64], [False, False, True], 1, 16, 8), covariate_dim=2)
    recipe = system_recipe({"lr": 2e-3, "warmup_steps": 10}, {"decay": 0.9, "start_step": 20}, DDPM_X0,
                           guidance={"drop_prob": drop_prob})
    process = build_process(diffusion_settings(DDPM_X0), clip_range=encoded_range(encoding))
    step = TrainStep(build_unet_from_spec(spec), recipe, encoding=encoding, mode="bravo", process=process)
    step.configure_optimizer(total_steps=STEPS)
    g = torch.Generator().manual_seed(2)
    for _ in range(STEPS):
        c = torch.rand(BATCH, generator=g)
        told = torch.rand(BATCH, generator=g) if independent else c  # the control: unrelated covariates
        step.run({"image": volumes(c), "mask": torch.zeros(BATCH, 1, SIZE, SIZE, SIZE), "covariates": encoded(told)})
    return step


def effect(step: TrainStep, guidance_scale: float = 1.0) -> tuple[float, float]:
    """(slope of generated size on the requested c / the real slope, Pearson r) over 8 values in [0, 1]."""
    c = torch.linspace(0, 1, 8)
    out = step.generate(torch.zeros(8, 1, SIZE, SIZE, SIZE), 8, 20, generator=torch.Generator().manual_seed(3),
                        covariates=encoded(c), batch_size=4, guidance_scale=guidance_scale)
    generated, real = dark(out), dark(volumes(c))

    def slope(y: torch.Tensor) -> float:
        return float(((c - c.mean()) * (y - y.mean())).sum() / ((c - c.mean()) ** 2).sum())

    return slope(generated) / slope(real), float(torch.corrcoef(torch.stack([c, generated]))[0, 1])


def test_samples_obey_a_covariate_and_the_independent_control_does_not() -> None:
    """Measured: 0.82 of the real effect (r 0.95), 1.03 with guidance scale 2; the control −0.03 (r −0.14)."""
    step = trained_step()
    plain, r = effect(step)
    guided, _ = effect(step, guidance_scale=2.0)  # the null covariates were trained: guidance applies to them
    control, _ = effect(trained_step(independent=True))
    assert plain >= OBEYS and r > 0.8, f"{plain:.2f} of the real effect, r {r:.2f}"
    assert guided >= OBEYS, f"guided: {guided:.2f}"
    assert control < OBEYS, f"the independent control reached {control:.2f} of the real effect"
    assert plain - control > 0.4
