"""What ``sample.py`` and ``evaluate.py`` sample with: their arguments against the run's settings."""

from __future__ import annotations

import pytest

from voxdiff.diffusion import diffusion_settings
from voxdiff.errors import ConfigError
from voxdiff.step.sampling import sampler_choice, sampling_settings

DDPM = diffusion_settings({"eta": 0.5})
RFLOW = diffusion_settings({"process": "rflow"})


def test_as_trained_unless_the_command_says_otherwise() -> None:
    trained = sampling_settings({"num_inference_steps": 20, "guidance_scale": 2.0}, drop_prob=0.1)
    choice = sampler_choice(DDPM, trained, "bravo", 0.1)
    assert (choice.sampler, choice.num_inference_steps, choice.eta, choice.guidance_scale) == ("DDIM", 20, 0.5, 2.0)
    choice = sampler_choice(RFLOW, sampling_settings({}), "bravo", 0.1, guidance_scale=3, num_inference_steps=8)
    assert (choice.sampler, choice.num_inference_steps, choice.eta, choice.guidance_scale) == ("Euler", 8, None, 3.0)
    assert choice.describe() == "Euler 8 steps, guidance scale 3"
    assert sampler_choice(RFLOW, sampling_settings({}), "bravo", 0.0).num_inference_steps == 30  # rflow's default


def test_rectified_flow_refuses_an_eta() -> None:
    with pytest.raises(ConfigError, match="eta=0.5: rectified flow"):
        sampler_choice(RFLOW, sampling_settings({}), "bravo", 0.0, eta=0.5)


def test_a_scale_the_model_was_not_trained_for_is_refused() -> None:
    with pytest.raises(ConfigError, match="guidance_scale=2.0: needs a model trained with condition dropout"):
        sampler_choice(DDPM, sampling_settings({}), "bravo", 0.0, guidance_scale=2.0)
    with pytest.raises(ConfigError, match="system.sampling.guidance_scale"):
        sampling_settings({"guidance_scale": 2.0}, mode="seg")
    with pytest.raises(ConfigError, match="system.sampling.batch_size"):
        sampling_settings({"batch_size": 0})
