"""The preflight with ``data.covariates``: it builds the run's UNet with its covariate embedding, so the extra
parameters (and their gradients, AdamW state and EMA) are counted, the batch carries ``covariates (B, K)`` and
sampling is traced with them; the traced peaks match the CPU allocator's as they do without covariates."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from cpu_allocator import profiler_peaks
from voxdiff.diffusion import DiffusionProcess
from voxdiff.encodings import SpaceToDepth
from voxdiff.models.unet import build_unet_from_spec, unet_spec
from voxdiff.preflight.memory import predict_memory, predict_phases, trace_sampling, trace_validation
from voxdiff.preflight.world import CudaAutocastEmulator, EmulatedPrecision
from voxdiff.run.spec import run_spec
from voxdiff.step import TrainStep, system_recipe


def test_the_preflight_counts_the_covariate_embedding(tiny_cfg) -> None:
    plain = run_spec(tiny_cfg(), "cuda")
    covariates = run_spec(tiny_cfg("data.covariates=[age,sex]", "system.guidance.drop_prob=0.1",
                                   "system.sampling.guidance_scale=2"), "cuda")
    k, e = 1 + 2 + 1, 4 * 16  # age, sex's two levels, presence; E = 4 * channels[0] of TINY_UNET
    assert covariates.unet.covariate_dim == k and covariates.batch["covariates"] == (1, k)
    extra = k * e + e + e * e + e
    before, after = predict_memory(plain, compile=False), predict_memory(covariates, compile=False)
    assert after.params - before.params == extra
    assert after.param_bytes - before.param_bytes >= 4 * extra
    assert 0 < after.peak_allocated - before.peak_allocated < 64 * extra  # weights, grads, AdamW, EMA: no more
    phases = predict_phases(covariates, after)  # validation and (guided) sampling traced with covariates
    assert phases.sample_batch == 2 and phases.sampling > 0 and phases.validation > 0


def _step_with_covariates(batch: dict) -> TrainStep:
    torch.manual_seed(0)
    model = build_unet_from_spec(replace(unet_spec(16, 8, [8, 16], [False, True], 1, 8, 4), covariate_dim=3))
    recipe = system_recipe({"lr": 1e-3}, {"decay": 0.9}, {"num_inference_steps": 2}, guidance={"drop_prob": 0.5})
    step = TrainStep(model, recipe, encoding=SpaceToDepth(2), process=DiffusionProcess(recipe.diffusion, clip_range=1.0),
                     precision=EmulatedPrecision(CudaAutocastEmulator(device_type="cpu", enabled=False)))
    step.configure_optimizer()
    step.run({k: torch.rand(s) for k, s in batch.items()})
    return step


def test_validation_and_guided_sampling_with_covariates_match_the_cpu_allocator(one_thread) -> None:
    volume = (16, 32, 32)
    batch = {"image": (2, 1, *volume), "mask": (2, 1, *volume), "covariates": (2, 3)}
    step = _step_with_covariates(batch)
    for fn in (lambda: trace_validation(step, batch, 4, device_type="cpu"),
               lambda: trace_sampling(step, (2, 1, *volume), 8, 2, device_type="cpu", guidance_scale=2.0,
                                      covariate_dim=3)):
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            trace = fn()
        assert trace.peak - trace.start_bytes == pytest.approx(profiler_peaks(prof)[1], rel=0.05)
