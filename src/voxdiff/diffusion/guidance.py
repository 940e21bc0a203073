"""Classifier-free guidance (Ho & Salimans 2022): condition dropout in training, guided predictions in sampling.

Training replaces the condition of each sample, with probability ``system.guidance.drop_prob``, by the *null
condition*: an all-zero conditioning input. No real mask encodes to it with a weight-free encoding: those see masks
in {-1, 1}, so every encoded voxel of a mask has a non-zero entry (space-to-depth copies them, Haar is an
invertible orthonormal map of them; ``tests/diffusion/test_guidance.py``). A learned encoding's latent of a mask
is its encoder's output for a volume in [0, 1]; nothing guarantees it is never all zero, but an encoder that mapped
a mask to exactly zero in every channel of a voxel would be a degenerate one.

Covariates (``data.covariates``: a ``(B, K)`` vector per sample, :mod:`voxdiff.data.covariates`) are dropped
*jointly* with the mask: a dropped sample gets both the null mask and the null covariates (all zeros, presence 0),
so the one unconditional prediction is unconditional in everything, and a guidance scale pushes towards mask and
covariates together (``s · (cond(mask, covariates) − uncond)``).

Sampling with a scale ``s`` mixes the two predictions of the same noisy input::

    out = uncond + s · (cond − uncond)

``s = 1`` is the conditional prediction itself (the unconditional one is then not computed at all, so the sample
is bit-for-bit the unguided one); ``s = 0`` is the unconditional model; ``s > 1`` pushes the sample towards what
the condition implies. The conditional and unconditional halves run as one batched forward of ``2B`` samples.

Both can run at once: ``denoiser(autoguided(model, guide, w), cond, s)`` guides the autoguided predictions (each
half ``guide + w · (model − guide)``, the model and the guide each one forward of ``2B``).

Either guidance (this one, or autoguidance: :func:`autoguided`) can be limited to an interval of the noise levels
(Kynkäänniemi et al. 2024, "Applying guidance in a limited interval improves sample and distribution quality in
diffusion models"): ``guidance_interval = [lo, hi]``, fractions of the training schedule (``t / T``: 0 clean, 1 pure
noise), guides the sampling steps whose timestep lies within it and lets the others take the model's own
conditional prediction, one forward of ``B`` (:func:`step_denoisers`). ``[0, 1]``, the default, guides every step
exactly as before.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from voxdiff.diffusion.batch import model_input
from voxdiff.errors import ConfigError, integer, number, settings_from

Model = Callable[..., torch.Tensor]
#: ``denoise(x, t) -> prediction``: ``x (B, C_out, d, h, w)`` the noisy sample, ``t (B,)`` its timesteps
Denoiser = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class GuidanceSettings:
    """``system.guidance``: how the condition is dropped while training."""

    drop_prob: float = 0.0  # probability of the null condition per training sample (0: no guidance possible)


def guidance_settings(values: Mapping[str, Any] | None, mode: str = "bravo") -> GuidanceSettings:
    """Validate ``system.guidance`` (a plain mapping; None: the defaults) for ``mode``.

    Raises:
        ConfigError: naming the key, the value and a fix (``mode=seg`` has no condition to drop).
    """
    s = settings_from(GuidanceSettings, "system.guidance", values)
    number("system.guidance.drop_prob", s.drop_prob, lo=0, hi=1, hi_open=True,
           fix="use e.g. system.guidance.drop_prob=0.1 (MAISI's), or 0 for no condition dropout")
    if mode == "seg" and s.drop_prob > 0:
        raise ConfigError("system.guidance.drop_prob", s.drop_prob,
                          "means nothing in mode=seg: masks are generated without a condition",
                          "use system.guidance.drop_prob=0 with mode=seg")
    return s


def check_guidance_scale(key: str, scale: Any, mode: str, drop_prob: float) -> float:
    """A guidance scale for a model of ``mode`` trained with condition dropout ``drop_prob``.

    Raises:
        ConfigError: not a number ≥ 0; any scale but 1 in ``mode=seg`` (no condition) or for a model trained
            without condition dropout (its unconditional prediction was never trained).
    """
    s = number(key, scale, lo=0, fix=f"use e.g. {key}=2.0 (MAISI's), or 1 for no guidance")
    if s != 1.0 and mode == "seg":
        raise ConfigError(key, scale, "means nothing in mode=seg: masks are generated without a condition",
                          f"use {key}=1 with mode=seg")
    if s != 1.0 and drop_prob <= 0:
        raise ConfigError(key, scale, "needs a model trained with condition dropout (system.guidance.drop_prob > 0); "
                          "this one was trained with drop_prob=0, so it has no unconditional prediction",
                          f"use {key}=1, or train with system.guidance.drop_prob=0.1")
    return s


def check_autoguide_scale(key: str, scale: Any, null: bool = False) -> float:
    """An autoguidance scale (:func:`autoguided`): a number ≥ 0, 1 for none; ``null``: the key also takes null (as
    trained), which the fix says.

    Raises:
        ConfigError: naming the key, the value and a fix.
    """
    return number(key, scale, lo=0, fix=f"e.g. {key}=1.25 (with the run's guide snapshot, callbacks.guide.step), "
                  f"1 for none{', or null as trained' if null else ''}")


def check_guide_step(step: Any) -> int | None:
    """``callbacks.guide.step``: the optimizer step after which a run keeps its guide snapshot, a positive integer;
    None: no snapshot.

    Raises:
        ConfigError: naming the key, the value and a fix.
    """
    if step is None:
        return None
    return integer("callbacks.guide.step", step, minimum=1,
                   fix="e.g. callbacks.guide.step=200 (about a third of the run), or null for no guide snapshot")


#: guidance at every sampling step: ``[lo, hi]`` as fractions of the training schedule (``t / T``)
FULL_INTERVAL: tuple[float, float] = (0.0, 1.0)


def check_guidance_interval(key: str, value: Any, null: bool = False) -> tuple[float, float] | None:
    """``[lo, hi]``: two numbers with ``0 <= lo < hi <= 1``, the fractions of the training schedule (``t / T``)
    between which a sampler guides; ``null``: the key also takes null (as trained), returned as None.

    Raises:
        ConfigError: naming the key, the value and a fix.
    """
    if value is None and null:
        return None
    fix = (f"e.g. {key}=[0,0.2] (guide the last, least noisy fifth of the schedule), {key}=[0,1] (every step)"
           f"{', or null as trained' if null else ''}")
    what = "must be [lo, hi] with 0 <= lo < hi <= 1, fractions of the training schedule (t / T: 0 clean, 1 pure " \
           "noise): it guides the sampling steps whose t / T lies within"
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or len(value) != 2:
        raise ConfigError(key, value, what, fix)
    try:
        lo, hi = (number(key, v, lo=0, hi=1) for v in value)
    except ConfigError:
        raise ConfigError(key, list(value), what, fix) from None
    if lo >= hi:
        raise ConfigError(key, list(value), what, fix)
    return lo, hi


def in_interval(t: float, num_train_timesteps: int, interval: tuple[float, float] | None) -> bool:
    """Whether a sampling step at timestep ``t`` (of a schedule of ``num_train_timesteps``) is guided: ``lo <= t / T
    <= hi`` (None: every step)."""
    if interval is None:
        return True
    return interval[0] <= float(t) / num_train_timesteps <= interval[1]


def guided_steps(key: str, interval: tuple[float, float], times: Sequence[float],
                 num_train_timesteps: int) -> list[bool]:
    """For each sampling step at ``times``, whether ``interval`` guides it (:func:`in_interval`).

    Raises:
        ConfigError: naming ``key``: the interval holds none of the steps, so a guidance asked for would never run.
    """
    inside = [in_interval(t, num_train_timesteps, interval) for t in times]
    if times and not any(inside):
        raise ConfigError(key, list(interval), f"holds none of the {len(times)} sampling steps (t / T from "
                          f"{max(times) / num_train_timesteps:.3g} down to {min(times) / num_train_timesteps:.3g}), "
                          "so the guidance asked for would never run",
                          f"widen it to hold some of them, e.g. {key}=[0,0.2], or guide no step (scale 1)")
    return inside


def drop_condition(cond: torch.Tensor, drop_prob: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """``cond (B, C_cond, d, h, w)`` with each sample replaced by the null condition (zeros) with ``drop_prob``."""
    return drop_conditions(cond, None, drop_prob, generator)[0]


def drop_conditions(cond: torch.Tensor | None, covariates: torch.Tensor | None, drop_prob: float,
                    generator: torch.Generator | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``cond (B, C_cond, d, h, w)`` and ``covariates (B, K)`` (either may be None), each sample replaced by the null
    condition and the null covariates (zeros) *together* with ``drop_prob`` (one draw per sample: joint dropout)."""
    first = cond if cond is not None else covariates
    if drop_prob <= 0 or first is None:
        return cond, covariates
    keep = torch.rand(first.shape[0], device=first.device, generator=generator) >= drop_prob  # (B,), one draw each
    return tuple(None if x is None else x * keep.to(x.dtype).view(-1, *([1] * (x.dim() - 1)))
                 for x in (cond, covariates))


class Autoguided:
    """The prediction of :func:`autoguided`: ``guide(x) + scale · (model(x) − guide(x))``; ``model`` is kept so that a
    sampler can call it alone outside the guidance interval (:func:`step_denoisers`)."""

    def __init__(self, model: Model, guide: Model, scale: float) -> None:
        self.model, self.guide, self.scale = model, guide, scale

    def __call__(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        good = self.model(x, *args, **kwargs).float()
        bad = self.guide(x, *args, **kwargs).float()
        return bad + self.scale * (good - bad)


def autoguided(model: Model, guide: Model | None, scale: float = 1.0) -> Model:
    """Autoguidance (Karras et al. 2024, "Guiding a diffusion model with a bad version of itself"): ``model``'s
    prediction pushed away from that of ``guide``, the same network less trained, as
    ``guide(x) + scale · (model(x) − guide(x))``, both called with the same arguments (the noisy input with its
    condition, the timesteps, the covariates). Where classifier-free guidance pushes away from the unconditional
    prediction, and so follows the condition harder, this pushes away from the guide's errors, which a short run
    makes mostly where the subject varies (the anatomy the condition does not fix). The predictions mix linearly,
    as the denoisers of the paper do: for x₀, ε, v and velocity predictions alike the mixed output is the mixed
    denoiser. ``scale = 1`` (or no guide) is ``model`` itself, untouched.

    Returns:
        A callable like ``model`` (an :class:`Autoguided`): ``(N, C_out, d, h, w)`` float32.
    """
    if guide is None or scale == 1.0:
        return model
    return Autoguided(model, guide, scale)


def with_covariates(model: Model, covariates: torch.Tensor | None) -> Model:
    """``model`` called with the covariates ``(B, K)`` as MONAI's ``class_labels`` (the covariate embedding,
    :mod:`voxdiff.models.covariates`); ``model`` itself without covariates."""
    if covariates is None:
        return model
    return lambda x, timesteps: model(x, timesteps=timesteps, class_labels=covariates)


def denoiser(model: Model, cond: torch.Tensor | None, scale: float = 1.0,
             covariates: torch.Tensor | None = None) -> Denoiser:
    """The model's (guided) prediction for noisy samples, as the samplers call it.

    Args:
        model: the UNet, called as ``model(x, timesteps=t)`` with ``x (N, C_out + C_cond, d, h, w)`` (and
            ``class_labels=(N, K)`` with covariates).
        cond: ``(B, C_cond, d, h, w)`` the clean condition, or None (seg mode).
        scale: the guidance scale (1: the conditional prediction alone; see the module doc).
        covariates: ``(B, K)`` the covariate vectors, or None (a model without covariates); guidance drops them
            with the mask.

    Returns:
        ``denoise(x, t)`` giving ``(B, C_out, d, h, w)`` float32.
    """
    if cond is None and (covariates is None or scale == 1.0):
        return lambda x, t: with_covariates(model, covariates)(x, timesteps=t).float()
    if scale == 1.0:
        return lambda x, t: with_covariates(model, covariates)(model_input(x, cond), timesteps=t).float()
    both = None if cond is None else torch.cat([cond, torch.zeros_like(cond)], dim=0)  # (2B, C_cond, ...)
    doubled = with_covariates(model, None if covariates is None
                              else torch.cat([covariates, torch.zeros_like(covariates)], dim=0))  # (2B, K)

    def guided(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        x2 = torch.cat([x, x], dim=0)  # (2B, C_out, ...)
        x_in = model_input(x2, both)  # (2B, C_out + C_cond, ...)
        out = doubled(x_in, timesteps=torch.cat([t, t])).float()
        c, u = out.chunk(2, dim=0)
        return u + scale * (c - u)

    return guided


def step_denoisers(model: Model, cond: torch.Tensor | None, scale: float, covariates: torch.Tensor | None,
                   times: Sequence[float], num_train_timesteps: int,
                   interval: tuple[float, float] | None = None) -> list[Denoiser]:
    """The denoiser of each sampling step at ``times`` (the sampler's timesteps, in order): the guided one
    (:func:`denoiser` at ``scale``, through ``model``'s autoguidance if it has it) where the step's ``t / T`` lies in
    ``interval`` (:func:`in_interval`; None or ``[0, 1]``: every step), elsewhere the model's own conditional
    prediction, one forward of ``B`` without the guide.

    Raises:
        ConfigError: ``guidance_interval`` holds none of the steps while guidance was asked for (it would never
            run).
    """
    guided = denoiser(model, cond, scale, covariates)
    guiding = scale != 1.0 or isinstance(model, Autoguided)
    if interval is None or tuple(interval) == FULL_INTERVAL or not guiding:  # every step guided (or none asked for)
        return [guided] * len(times)
    inside = guided_steps("guidance_interval", interval, times, num_train_timesteps)
    plain_model = model.model if isinstance(model, Autoguided) else model
    unguided = denoiser(plain_model, cond, 1.0, covariates)
    return [guided if i else unguided for i in inside]
