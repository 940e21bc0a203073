"""What ``sample.py`` and ``evaluate.py`` sample with: their arguments against the run's settings."""

from __future__ import annotations

import pytest

from voxdiff.diffusion import diffusion_settings
from voxdiff.errors import ConfigError
from voxdiff.step.sampling import check_interval_steps, sampler_choice, sampling_settings

DDPM = diffusion_settings({"eta": 0.5})
RFLOW = diffusion_settings({"process": "rflow"})


def test_as_trained_unless_the_command_says_otherwise() -> None:
    trained = sampling_settings({"num_inference_steps": 20, "guidance_scale": 2.0}, drop_prob=0.1)
    choice = sampler_choice(DDPM, trained, "bravo", 0.1)
    assert (choice.sampler, choice.num_inference_steps, choice.eta, choice.guidance_scale) == ("DDIM", 20, 0.5, 2.0)
    choice = sampler_choice(RFLOW, sampling_settings({}), "bravo", 0.1, guidance_scale=3, num_inference_steps=8)
    assert (choice.sampler, choice.num_inference_steps, choice.eta, choice.guidance_scale) == ("Euler", 8, 0.0, 3.0)
    assert choice.describe() == "Euler 8 steps, guidance scale 3"
    assert sampler_choice(RFLOW, sampling_settings({}), "bravo", 0.0).num_inference_steps == 30  # rflow's default


def test_rectified_flow_takes_an_eta_as_ddim_does() -> None:
    choice = sampler_choice(RFLOW, sampling_settings({}), "bravo", 0.0, eta=0.5)
    assert choice.eta == 0.5 and choice.describe() == "Euler 30 steps, eta 0.5"
    trained = diffusion_settings({"process": "rflow", "eta": 1.0})
    assert sampler_choice(trained, sampling_settings({}), "bravo", 0.0).eta == 1.0


def test_a_scale_the_model_was_not_trained_for_is_refused() -> None:
    with pytest.raises(ConfigError, match="guidance_scale=2.0: needs a model trained with condition dropout"):
        sampler_choice(DDPM, sampling_settings({}), "bravo", 0.0, guidance_scale=2.0)
    with pytest.raises(ConfigError, match="system.sampling.guidance_scale"):
        sampling_settings({"guidance_scale": 2.0}, mode="seg")
    with pytest.raises(ConfigError, match="system.sampling.batch_size"):
        sampling_settings({"batch_size": 0})


def test_the_guidance_interval_is_as_trained_unless_the_command_says_otherwise() -> None:
    trained = sampling_settings({"guidance_scale": 2.0, "guidance_interval": [0, 0.3]}, drop_prob=0.1)
    assert trained.guidance_interval == (0.0, 0.3)
    assert sampler_choice(DDPM, trained, "bravo", 0.1).guidance_interval == (0.0, 0.3)
    choice = sampler_choice(DDPM, trained, "bravo", 0.1, guidance_interval=[0.1, 0.6], num_inference_steps=10)
    assert choice.guidance_interval == (0.1, 0.6)
    assert choice.describe() == "DDIM 10 steps, eta 0.5, guidance scale 2 at t/T in [0.1, 0.6]"
    # unguided, an interval has nothing to limit and is not described; by default it is the whole schedule
    assert sampler_choice(DDPM, trained, "bravo", 0.1, guidance_scale=1).describe() == "DDIM 50 steps, eta 0.5"
    assert sampling_settings({}).guidance_interval == (0.0, 1.0)
    with pytest.raises(ConfigError, match=r"system.sampling.guidance_interval=\[0.5, 0.1\]: must be \[lo, hi\]"):
        sampling_settings({"guidance_interval": [0.5, 0.1]})
    with pytest.raises(ConfigError, match=r"guidance_interval=\[0, 3\]: must be \[lo, hi\]"):
        sampler_choice(DDPM, trained, "bravo", 0.1, guidance_interval=[0, 3])


def test_an_interval_must_hold_one_of_the_steps_the_sampler_takes() -> None:
    """DDIM's 10 steps reach t/T 0.999; rectified flow's timestep transform shifts its steps towards the noisy end
    for a larger encoding, so the same interval can hold a step of a small encoding and none of a large one."""
    check_interval_steps("k", (0.95, 1.0), 10, DDPM, (8, 16, 16, 16))
    with pytest.raises(ConfigError, match=r"k=\[0.9995, 1.0\]: holds none of the 10 sampling steps"):
        check_interval_steps("k", (0.9995, 1.0), 10, DDPM, (8, 16, 16, 16))
    shifted = diffusion_settings({"process": "rflow", "timestep_transform": True})
    small, large = (8, 8, 8, 8), (8, 64, 64, 64)
    check_interval_steps("k", (0.0, 0.1), 5, shifted, small)
    with pytest.raises(ConfigError, match=r"k=\[0.0, 0.1\]: holds none of the 5 sampling steps"):
        check_interval_steps("k", (0.0, 0.1), 5, shifted, large)


def test_a_mask_models_weight_is_undone_unless_the_command_says_not() -> None:
    """mode=seg with diffusion.mask_weight: each step's x0 is unweighted by default (described, so the report and
    the console say so); unweight=false samples the weighted model; nothing to undo in bravo mode or without a
    weight; a learned encoding's weight cannot be undone, which unweight=true is told."""
    weighted = diffusion_settings({"mask_weight": 20.0})
    choice = sampler_choice(weighted, sampling_settings({}), "seg", 0.0)
    assert choice.mask_weight_undone == 20.0 and choice.describe().endswith(", mask weight 20 undone")
    assert sampler_choice(weighted, sampling_settings({}), "seg", 0.0, unweight=False).mask_weight_undone == 0.0
    assert sampler_choice(weighted, sampling_settings({}), "bravo", 0.0).mask_weight_undone == 0.0
    assert sampler_choice(DDPM, sampling_settings({}), "seg", 0.0, unweight=True).mask_weight_undone == 0.0
    assert sampler_choice(weighted, sampling_settings({}), "seg", 0.0, weight_free=False).mask_weight_undone == 0.0
    with pytest.raises(ConfigError, match="unweight=true: cannot undo diffusion.mask_weight=20 .* learned encoding"):
        sampler_choice(weighted, sampling_settings({}), "seg", 0.0, unweight=True, weight_free=False)
    with pytest.raises(ConfigError, match="unweight=yes: must be true or false"):
        sampler_choice(weighted, sampling_settings({}), "seg", 0.0, unweight="yes")
