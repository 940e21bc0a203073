"""``system.sampling`` and ``system.val_timesteps``: what the diffusion system samples and validates during
training, validated before anything is built (Lightning-free: the run spec and the preflight read it too)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from voxdiff.diffusion.batch import mask_weight_to_undo
from voxdiff.diffusion.guidance import (
    FULL_INTERVAL,
    check_autoguide_scale,
    check_guidance_interval,
    check_guidance_scale,
    guided_steps,
)
from voxdiff.diffusion.processes import build_process
from voxdiff.errors import ConfigError, boolean, integer, plain, settings_from


@dataclass(frozen=True)
class SamplingSettings:
    """``system.sampling``: samples conditioned on validation masks during training."""

    every_n_epochs: int = 10  # 0: never (besides the end of training when final is true)
    num_masks: int = 2  # validation masks to sample from
    num_inference_steps: int | None = None  # sampling steps; None = diffusion.num_inference_steps
    seed: int = 0  # generator seed of the validation noise and of the sampling noise (same every epoch)
    final: bool = True  # also sample when training ends
    guidance_scale: float = 1.0  # classifier-free guidance (needs system.guidance.drop_prob > 0); 1 = none
    batch_size: int = 1  # masks sampled at once (the sampling peak is one such chunk's)
    # autoguidance scale that sample.py / evaluate.py take by default for this run, with its guide snapshot
    # (callbacks.guide.step); sampling during training never autoguides (it would hold a second UNet)
    autoguide_scale: float = 1.0
    # [lo, hi] fractions of the schedule (t / T: 0 clean, 1 pure noise) whose sampling steps either guidance runs at;
    # the others take the model's conditional prediction alone (voxdiff.diffusion.guidance.step_denoisers)
    guidance_interval: tuple[float, float] = FULL_INTERVAL


def sampling_settings(sampling: Mapping[str, Any] | None, val_timesteps: Any = 4, mode: str = "bravo",
                      drop_prob: float = 0.0) -> SamplingSettings:
    """Validate ``system.sampling`` (a plain mapping; None: the defaults) and ``system.val_timesteps``, for a model of
    ``mode`` trained with condition dropout ``drop_prob`` (``system.guidance.drop_prob``).

    Raises:
        ConfigError: naming the key, the value and a fix.
    """
    s = settings_from(SamplingSettings, "system.sampling", sampling)
    s = replace(s, guidance_interval=check_guidance_interval("system.sampling.guidance_interval",
                                                             plain(s.guidance_interval)))
    integer("system.sampling.every_n_epochs", s.every_n_epochs, minimum=0, example="10")
    integer("system.sampling.num_masks", s.num_masks, minimum=0, example="2")
    if s.num_inference_steps is not None:
        integer("system.sampling.num_inference_steps", s.num_inference_steps, minimum=0, example="50")
        if s.num_inference_steps == 0:
            raise ConfigError("system.sampling.num_inference_steps", 0, "must be positive or null",
                              "use null for diffusion.num_inference_steps")
    integer("system.sampling.seed", s.seed, minimum=0, example="0")
    integer("system.val_timesteps", val_timesteps, minimum=0, example="4")
    if val_timesteps == 0:
        raise ConfigError("system.val_timesteps", 0, "must be positive", "e.g. system.val_timesteps=4")
    boolean("system.sampling.final", s.final, fix="use true")
    check_guidance_scale("system.sampling.guidance_scale", s.guidance_scale, mode, drop_prob)
    integer("system.sampling.batch_size", s.batch_size, minimum=1, example="1")
    check_autoguide_scale("system.sampling.autoguide_scale", s.autoguide_scale)
    return s


@dataclass(frozen=True)
class SamplerChoice:
    """How ``sample.py`` / ``evaluate.py`` sample a trained model, resolved from their arguments and the run's
    settings (what they print and what the evaluation report records)."""

    sampler: str  # DDIM (ddpm) | Euler (rflow)
    num_inference_steps: int
    eta: float  # DDIM's, or rectified flow's (0: Euler's deterministic steps)
    guidance_scale: float  # 1: none
    autoguide_scale: float = 1.0  # autoguidance by the run's guide snapshot (voxdiff.diffusion.guidance.autoguided)
    guidance_interval: tuple[float, float] = FULL_INTERVAL  # t / T of the steps either guidance runs at
    # a mask model's diffusion.mask_weight whose bias each step's predicted x0 has undone (0: none undone;
    # voxdiff.diffusion.batch.unweighted_mask_prediction)
    mask_weight_undone: float = 0.0

    @property
    def unweights(self) -> bool:
        """Whether a mask weight's bias is undone (what ``TrainStep.generate``'s ``unweight`` takes)."""
        return self.mask_weight_undone > 0

    @property
    def guided(self) -> bool:
        """Whether either guidance runs."""
        return self.guidance_scale != 1.0 or self.autoguide_scale != 1.0

    def describe(self) -> str:
        eta = f", eta {self.eta:g}" if self.eta or self.sampler == "DDIM" else ""
        guide = f", guidance scale {self.guidance_scale:g}" if self.guidance_scale != 1.0 else ""
        auto = f", autoguidance scale {self.autoguide_scale:g}" if self.autoguide_scale != 1.0 else ""
        lo, hi = self.guidance_interval
        interval = f" at t/T in [{lo:g}, {hi:g}]" if self.guided and self.guidance_interval != FULL_INTERVAL else ""
        undone = f", mask weight {self.mask_weight_undone:g} undone" if self.mask_weight_undone else ""
        return f"{self.sampler} {self.num_inference_steps} steps{eta}{guide}{auto}{interval}{undone}"


def sampler_choice(
    diffusion: Any,
    sampling: SamplingSettings,
    mode: str,
    drop_prob: float,
    *,
    num_inference_steps: Any = None,
    eta: Any = None,
    guidance_scale: Any = None,
    autoguide_scale: Any = None,
    guidance_interval: Any = None,
    unweight: Any = None,
    weight_free: bool = True,
) -> SamplerChoice:
    """The sampler a command runs: its own ``num_inference_steps``, ``eta``, ``guidance_scale``,
    ``autoguide_scale`` and ``guidance_interval`` (None: as trained — ``system.sampling``, then ``diffusion``) for
    the run's diffusion settings, mode and condition dropout; ``unweight`` (None: true) undoes a mask model's
    ``diffusion.mask_weight`` (``mode=seg`` on a ``weight_free`` encoding; elsewhere there is nothing to undo).

    Raises:
        ConfigError: naming the command's key (a guidance scale the model cannot do; ``unweight=true`` for a mask
            model whose weight cannot be undone: a learned encoding).
    """
    rflow = diffusion.process == "rflow"
    steps = num_inference_steps or sampling.num_inference_steps or diffusion.num_inference_steps
    scale = check_guidance_scale("guidance_scale", sampling.guidance_scale if guidance_scale is None else guidance_scale,
                                 mode, drop_prob)
    # autoguidance: the command's scale (beside classifier-free guidance too: voxdiff.diffusion.guidance.step_denoisers
    # guides the autoguided prediction), else the run's unless classifier-free guidance runs, in which case none
    if autoguide_scale is None:
        auto = sampling.autoguide_scale if scale == 1.0 else 1.0
    else:
        auto = check_autoguide_scale("autoguide_scale", autoguide_scale, null=True)
    interval = check_guidance_interval("guidance_interval", plain(guidance_interval), null=True)
    undoable = mask_weight_to_undo(mode, diffusion, weight_free)
    weight = mask_weight_to_undo(mode, diffusion, True)  # the seg model's weight, undoable or not
    undo = True if unweight is None else boolean("unweight", unweight, fix="use unweight=true (the default) or false")
    if unweight is not None and undo and weight and not undoable:
        raise ConfigError("unweight", unweight, f"cannot undo diffusion.mask_weight={weight:g} of a mask model on a "
                          "learned encoding (its decoder is not linear, so the bias is not undone voxel by voxel)",
                          "use unweight=false (its masks over-draw lesions), or train it with diffusion.mask_weight=0")
    return SamplerChoice(sampler="Euler" if rflow else "DDIM", num_inference_steps=int(steps),
                         eta=float(diffusion.eta if eta is None else eta), guidance_scale=scale,
                         autoguide_scale=float(auto),
                         guidance_interval=sampling.guidance_interval if interval is None else interval,
                         mask_weight_undone=undoable if undo else 0.0)


def check_interval_steps(key: str, interval: tuple[float, float], steps: int, diffusion: Any,
                         encoded: Sequence[int]) -> None:
    """A guidance interval holds at least one of the sampler's ``steps`` (else the guidance asked for would never
    run): ``diffusion``, the process settings; ``encoded``, ``(C, d, h, w)`` of an encoding (rectified flow's
    timesteps depend on its voxels). Checked where a run or a command starts, before anything is sampled.

    Raises:
        ConfigError: naming ``key``, the interval, the steps' range and a fix.
    """
    if tuple(interval) == FULL_INTERVAL:
        return
    times = build_process(diffusion).sampling_timesteps(int(steps), math.prod(encoded[1:]))
    guided_steps(key, interval, times, diffusion.num_train_timesteps)
