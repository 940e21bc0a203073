"""Rectified flow (Liu et al. 2023; Esser et al. 2024), on MONAI's ``RFlowScheduler``: ``diffusion=rflow``.

MONAI's convention, used throughout (``monai.networks.schedulers.rectified_flow``), with ``t ∈ [0, T]``, ``s = t/T``::

    x_t = (1 − s)·x₀ + s·ε                 (t = T: pure noise; t → 0: the data)
    v   = x₀ − ε = (x₀ − x_t)/s            the velocity; the loss is its MSE
    x_{t'} = x_t + v̂·(t − t')/T           one Euler step towards the data (t' < t)

The UNet predicts the velocity (``prediction_type: velocity``, MONAI's and MAISI's) or the clean encoding
(``sample``: x-prediction, Li & He 2025, "Back to Basics: Let Denoising Generative Models Denoise"), whose velocity
``(x̂₀ − x_t)/s`` is what the loss compares and the sampler steps along; the loss's ``1/s²`` is held at
``1/X0_MIN_S²`` near the data, where it would grow without bound (the paper's clip). A network that predicts the
data keeps to the data's low-dimensional structure where one predicting ``x₀ − ε`` must also carry the noise; on a
short run it draws a coarse head early, as DDPM's x₀-prediction does (``docs/demo_recipe.md``).

With ``sigma_data`` set, an x-predicting UNet's output ``F`` is preconditioned as EDM's is (Karras et al. 2022,
"Elucidating the Design Space of Diffusion-Based Generative Models"), on this path::

    x̂₀ = c_skip(s)·x_t + c_out(s)·F,   c_skip = (1 − s)·σ_d² / n²,   c_out = s·σ_d / n,   n² = (1 − s)²·σ_d² + s²

``c_skip`` is the least-squares coefficient of ``x₀`` on ``x_t`` for data of RMS ``σ_d``, and ``c_out`` the RMS of
what is left, so ``F``'s target has unit RMS at every ``s``; near the data ``x̂₀ → x_t`` (the identity) and at pure
noise ``x̂₀ = σ_d·F``. ``sigma_data`` is one RMS for every channel or one per channel of the encoding: a Haar
encoding's low-pass band carries √8 times a voxel's amplitude and its detail bands a hundredth of it, and one
``σ_d`` for all would make the detail bands' ``F`` predict the noise they are all but made of. A plain x-predicting UNet must rebuild the whole encoding from its input at every noise
level, and at the demo's budget a mask model shown a mask at 0.5% noise loses a third of its lesions under 15
voxels (``docs/demo_recipe.md``); the skip makes returning what it is shown the default. The loss is still the
velocity's MSE, now ``(c_out/s)²·‖F − F*‖²`` (``c_out/s = σ_d/n``, bounded: no clip needed).

EDM's coefficients are those of data of mean 0. ``data_mean`` (``μ``, one or one per channel) centres the path
first: ``x_t − (1 − s)·μ = (1 − s)·(x₀ − μ) + s·ε`` is the same path for the centred data, so::

    x̂₀ = μ + c_skip(s)·(x_t − (1 − s)·μ) + c_out(s)·F

with ``σ_d`` then the data's spread about ``μ``. A Haar mask's low-pass band is a constant −2.83 (the background)
with lesions a few hundredths of its RMS: uncentred, its ``σ_d`` is either that RMS (the skip passes the noise over
most of the path) or small (``F`` must output the background at ``−2.83/σ_d``).

Training timesteps are drawn uniformly or logit-normally (Esser et al. 2024, "Scaling Rectified Flow
Transformers"), rounded to MONAI's discrete grid, then — with ``timestep_transform`` — shifted by MONAI's
resolution-dependent transform towards the noisy end for encodings with more voxels than ``base_numel`` (a volume
of more voxels keeps its structure under more noise; MAISI v2 trains so). Sampling takes MONAI's Euler steps over
``num_inference_steps`` (30 by default, as MAISI v2) on the same transformed grid; with ``eta > 0`` each step
instead draws from the path's Gaussian posterior ``q(x_{t'} | x_t, x̂₀)`` with ``eta`` times its spread, DDIM's
``eta`` on the flow's path (0: the Euler step exactly, 1: ancestral sampling; :func:`flow_step`).

The settings of DDPM that mean nothing here (``min_snr_gamma``, the beta schedule, ``clip_sample``, the prediction
types ``epsilon`` and ``v_prediction``) are refused with the fix, not silently ignored.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch
from monai.networks.schedulers import RFlowScheduler
from monai.networks.schedulers.rectified_flow import timestep_transform
from torch import nn

from voxdiff.diffusion.batch import (check_mask_sdf_scale, check_mask_weight, check_pair, model_input,
                                     per_sample_mses)
from voxdiff.diffusion.guidance import step_denoisers
from voxdiff.errors import ConfigError, boolean, integer, number, one_of

TIMESTEP_SAMPLING = ("uniform", "logit-normal")
PREDICTION_TYPES = ("velocity", "sample")
#: the smallest ``s = t/T`` the x-prediction loss divides by (its weight ``1/s²`` held at 400 nearer the data: Li & He
#: 2025 clip the same denominator at 0.05)
X0_MIN_S = 0.05
#: the smallest ``s`` the preconditioning's coefficients are taken at (``s = 0``, a timestep MONAI's grid can draw,
#: would make ``F``'s target 0/0; at 1e-3 the skip is the identity to 0.1%)
SKIP_MIN_S = 1e-3
#: DDPM's settings, and why each means nothing for rectified flow (``configs/diffusion/rflow.yaml`` holds them as
#: null, so that ``diffusion.<key>=...`` on the command line reaches this message)
NOT_FOR_RFLOW = {
    "min_snr_gamma": "rectified flow's loss is the plain velocity MSE; there is no SNR weighting to set",
    "schedule": "rectified flow interpolates linearly between data and noise; there is no beta schedule",
    "beta_start": "rectified flow interpolates linearly between data and noise; there are no betas",
    "beta_end": "rectified flow interpolates linearly between data and noise; there are no betas",
    "clip_sample": "rectified flow's Euler steps do not predict x0 to clip",
}


@dataclass(frozen=True)
class RFlowSettings:
    """The validated ``diffusion:`` config of rectified flow (``configs/diffusion/rflow.yaml``)."""

    process: str = "rflow"
    num_train_timesteps: int = 1000  # T: the timestep range [0, T] the UNet's embedding sees
    prediction_type: str = "velocity"  # what the UNet predicts: velocity (v = x0 − ε) | sample (x0); the loss: v's MSE
    timestep_sampling: str = "logit-normal"  # uniform | logit-normal (sigmoid of N(loc, scale))
    logit_normal_loc: float = 0.0
    logit_normal_scale: float = 1.0
    timestep_transform: bool = True  # MONAI's resolution-dependent shift of the timesteps
    base_numel: int = 32 * 32 * 32  # the voxel count of the encoding at which the transform is the identity
    num_inference_steps: int = 30  # Euler steps when sampling
    eta: float = 0.0  # 0: deterministic Euler; up to 1: each step draws eta x the path's posterior spread
    mask_weight: float = 0.0  # the loss counts 1 + this where the mask is (voxdiff.diffusion.batch.mask_loss_weights)
    mask_sdf_scale: float | None = None  # seg mode: draw the mask's distance map (batch.mask_distance_map)
    # x-prediction preconditioned as EDM's with this data RMS, one for all channels or one per channel (None: the
    # output is x̂₀ itself)
    sigma_data: tuple[float, ...] | None = None
    # with sigma_data: the encodings' mean, one or one per channel, taken out before the preconditioning (None: 0)
    data_mean: tuple[float, ...] | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def rflow_settings(cfg: Mapping[str, Any] | None = None, **overrides: Any) -> RFlowSettings:
    """Validate a plain ``diffusion:`` mapping of rectified flow; every failure names the key, the value and a fix.

    Raises:
        ConfigError: an unknown key, a DDPM setting that is set (:data:`NOT_FOR_RFLOW`), or a value that cannot work.
    """
    values = {**dict(cfg or {}), **overrides}
    if values.get("eta", 0.0) is None:  # a run configured before rectified flow took an eta: deterministic Euler
        values["eta"] = 0.0
    for key, why in NOT_FOR_RFLOW.items():
        if values.pop(key, None) is not None:
            raise ConfigError(f"diffusion.{key}", cfg.get(key) if cfg else overrides.get(key), why,
                              f"remove diffusion.{key} (or set it to null), or use diffusion=ddpm")
    known = set(RFlowSettings.__dataclass_fields__)
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"diffusion.{unknown[0]}", values[unknown[0]], "is not a rectified-flow setting",
                          f"remove it; the settings are {', '.join(sorted(known))}")
    if values.get("prediction_type", "velocity") not in PREDICTION_TYPES:
        raise ConfigError("diffusion.prediction_type", values["prediction_type"],
                          "rectified flow's UNet predicts the velocity x0 − noise or the clean encoding x0",
                          "use diffusion.prediction_type=velocity or sample, or diffusion=ddpm for epsilon or "
                          "v_prediction")
    for key in ("sigma_data", "data_mean"):
        if isinstance(values.get(key), (list, tuple)):  # per channel; a number: one for all
            values[key] = tuple(values[key])
        elif values.get(key) is not None:
            values[key] = (values[key],)
    s = RFlowSettings(**values)
    one_of("diffusion.process", s.process, ("rflow",))
    t = integer("diffusion.num_train_timesteps", s.num_train_timesteps, minimum=1, example=1000)
    one_of("diffusion.timestep_sampling", s.timestep_sampling, TIMESTEP_SAMPLING)
    number("diffusion.logit_normal_loc", s.logit_normal_loc, example=0.0)
    number("diffusion.logit_normal_scale", s.logit_normal_scale, lo=0, lo_open=True, example=1.0)
    boolean("diffusion.timestep_transform", s.timestep_transform, fix="use true (MAISI's) or false")
    integer("diffusion.base_numel", s.base_numel, minimum=1, example=32768)
    steps = integer("diffusion.num_inference_steps", s.num_inference_steps, minimum=1, example=30)
    if steps > t:
        raise ConfigError("diffusion.num_inference_steps", steps,
                          f"cannot take more Euler steps than the {t} training timesteps", f"use at most {t} (e.g. 30)")
    number("diffusion.eta", s.eta, lo=0, hi=1,
           fix="use diffusion.eta=0 (deterministic Euler) up to 1 (ancestral: the posterior's whole spread)")
    check_mask_weight(s.mask_weight)
    check_mask_sdf_scale(s.mask_sdf_scale, s.mask_weight)
    if s.sigma_data is not None:
        shown = s.sigma_data[0] if len(s.sigma_data) == 1 else list(s.sigma_data)
        if not s.sigma_data:
            raise ConfigError("diffusion.sigma_data", [], "is empty", "give one RMS, or one per encoding channel")
        for value in s.sigma_data:
            number("diffusion.sigma_data", value, lo=0, lo_open=True, hi=100,
                   fix="use the RMS of the encodings in model range, one number or one per channel (a mask's "
                   "distance map: 1 overall), or null")
        if s.prediction_type != "sample":
            raise ConfigError("diffusion.sigma_data", shown, "preconditions an x-predicting UNet "
                              f"(prediction_type=sample); with prediction_type={s.prediction_type} the velocity "
                              "already carries x_t through the step", "set diffusion.prediction_type=sample, or "
                              "diffusion.sigma_data=null")
    if s.data_mean is not None:
        shown = s.data_mean[0] if len(s.data_mean) == 1 else list(s.data_mean)
        if s.sigma_data is None:
            raise ConfigError("diffusion.data_mean", shown, "centres EDM's preconditioning, and "
                              "diffusion.sigma_data is null", "set diffusion.sigma_data to the encodings' spread "
                              "about this mean (and diffusion.prediction_type=sample), or diffusion.data_mean=null")
        if not s.data_mean:
            raise ConfigError("diffusion.data_mean", [], "is empty", "give one mean, or one per encoding channel")
        for value in s.data_mean:
            number("diffusion.data_mean", value, lo=-100, hi=100,
                   fix="use the mean of the encodings in model range, one number or one per channel, or null")
    return s


def skip_coefficients(s: torch.Tensor, sigma_data: tuple[float, ...], channels: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(c_skip, c_out)`` of EDM's preconditioning on the path ``x_t = (1 − s)·x₀ + s·ε`` (module doc), each
    ``(B, channels, 1, 1, 1)`` float32 for ``s (B,)`` (``t/T``, held at :data:`SKIP_MIN_S` or above) and
    ``sigma_data`` one RMS or one per channel.

    Raises:
        ValueError: ``sigma_data`` has neither 1 nor ``channels`` values.
    """
    sd = per_channel(sigma_data, channels, "sigma_data", s.device)
    s = s.float().clamp(min=SKIP_MIN_S, max=1.0).view(-1, 1, 1, 1, 1)
    norm = ((1 - s) ** 2 * sd ** 2 + s ** 2).sqrt()  # (B, C, 1, 1, 1)
    return (1 - s) * sd ** 2 / norm ** 2, s * sd / norm


def per_channel(values: tuple[float, ...], channels: int, key: str, device: torch.device) -> torch.Tensor:
    """``values`` (one, or one per channel) as a float32 ``(1, channels, 1, 1, 1)`` tensor.

    Raises:
        ValueError: ``values`` has neither 1 nor ``channels`` entries, naming ``diffusion.<key>``.
    """
    if len(values) not in (1, channels):
        raise ValueError(f"diffusion.{key} has {len(values)} values for an encoding of {channels} channels: "
                         f"give one, or {channels} (one per channel)")
    return torch.tensor(values, dtype=torch.float32, device=device).expand(channels).view(1, channels, 1, 1, 1)


class RectifiedFlow(nn.Module):
    """Rectified-flow training loss and Euler sampling for one UNet: the same interface as
    :class:`voxdiff.diffusion.DiffusionProcess` (``loss``, ``sample``, ``num_train_timesteps``, ``weighted``,
    ``settings``).

    Args:
        settings: :func:`rflow_settings`.
        clip_range: unused (rectified flow does not clip); accepted so that every process is built alike.
    """

    #: the dtype of the ``(B,)`` training timesteps (continuous after MONAI's transform; DDPM's are int64)
    timestep_dtype = torch.float32

    def __init__(self, settings: RFlowSettings | None = None, clip_range: float | None = None) -> None:
        super().__init__()
        self.settings = settings if settings is not None else RFlowSettings()
        s = self.settings
        scheduler = RFlowScheduler(
            num_train_timesteps=s.num_train_timesteps, use_discrete_timesteps=True, sample_method="uniform",
            use_timestep_transform=s.timestep_transform, base_img_size_numel=s.base_numel, spatial_dim=3,
        )
        # MONAI's RFlowScheduler is an nn.Module whose __init__ never runs nn.Module's (MONAI 1.6): registered as a
        # submodule, it breaks named_modules(), .to() and Lightning. It holds no tensors, so it is kept unregistered.
        object.__setattr__(self, "scheduler", scheduler)

    @property
    def num_train_timesteps(self) -> int:
        return self.settings.num_train_timesteps

    @property
    def weighted(self) -> bool:
        """Whether the loss weights the MSE (the mask's weight): then the plain MSE is worth logging beside it."""
        return self.settings.mask_weight > 0

    def sample_timesteps(self, x0: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """Training timesteps ``(B,)`` float32 in ``[0, T)`` for encodings ``x0 (B, C, d, h, w)`` (see module doc).

        MONAI's ``RFlowScheduler.sample_timesteps`` draws from the global RNG; this draws from ``generator`` with
        the same distribution, grid and transform, so a fixed generator gives fixed timesteps.
        """
        s, b = self.settings, x0.shape[0]
        if s.timestep_sampling == "uniform":
            u = torch.rand(b, device=x0.device, generator=generator)
        else:  # the first coordinate of MONAI's LogisticNormal: sigmoid of a normal
            z = torch.randn(b, device=x0.device, generator=generator)
            u = torch.sigmoid(s.logit_normal_loc + s.logit_normal_scale * z)
        return self._transform((u * s.num_train_timesteps).long(), x0)

    def _transform(self, t: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
        if not self.settings.timestep_transform:
            return t.float()
        return timestep_transform(t.float(), input_img_size_numel=_numel(x0), base_img_size_numel=self.settings.base_numel,
                                  num_train_timesteps=self.num_train_timesteps, spatial_dim=3)

    def loss(
        self,
        model: Callable[..., torch.Tensor],
        x0: torch.Tensor,
        cond: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
        timesteps: torch.Tensor | None = None,
        noise: torch.Tensor | None = None,
        weights: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The training loss of one batch, as :meth:`voxdiff.diffusion.DiffusionProcess.loss` (same arguments and
        returns): the MSE of the predicted velocity against ``x0 − noise`` in fp32. With ``prediction_type: sample``
        the UNet's ``x̂₀`` gives the velocity ``(x̂₀ − x_t)/s``, so the MSE is ``‖x̂₀ − x₀‖²/s²`` (``s`` held at
        :data:`X0_MIN_S` or above); ``stats["mse"]`` is the velocity's MSE either way.

        ``timesteps`` given (the validation loss's fixed grid) are used as they are, untransformed.
        """
        check_pair(x0, cond)
        x0 = x0.float()
        t = timesteps.float() if timesteps is not None else self.sample_timesteps(x0, generator)  # (B,)
        if noise is None:
            noise = torch.randn(x0.shape, device=x0.device, dtype=torch.float32, generator=generator)
        x_t = self.add_noise(x0, noise, t)  # (1 − t/T)·x0 + (t/T)·ε, (B, C_out, d, h, w)
        x_in = model_input(x_t, cond)  # (B, C_out + C_cond, d, h, w)
        pred = model(x_in, timesteps=t).float()
        if self.settings.sigma_data is not None:  # F against its unit-RMS target, weighted to the velocity's MSE
            s = t / self.num_train_timesteps  # (B,)
            c_skip, c_out = skip_coefficients(s, self.settings.sigma_data, x0.shape[1])  # (B, C, 1, 1, 1) each
            mean = self._mean(x0)  # μ (1, C, 1, 1, 1), 0 without data_mean
            x0_c, x_t_c = x0 - mean, x_t - (1 - s.view(-1, 1, 1, 1, 1)) * mean  # the centred data and path
            # ‖x̂0 − x0‖²/s² = (c_out/s)²·‖F − F*‖², c_out/s per channel: folded into both sides of the MSE
            gain = c_out / s.clamp(min=SKIP_MIN_S).view(-1, 1, 1, 1, 1)  # (B, C, 1, 1, 1)
            per_sample, weighted = per_sample_mses(gain * pred, gain * (x0_c - c_skip * x_t_c) / c_out, weights)
        elif self.settings.prediction_type == "sample":  # x̂0: the velocity's error is x̂0's over s
            per_sample, weighted = per_sample_mses(pred, x0, weights)  # (B,), (B,)
            scale = (t / self.num_train_timesteps).clamp(min=X0_MIN_S) ** -2  # (B,)
            per_sample, weighted = per_sample * scale, weighted * scale
        else:
            per_sample, weighted = per_sample_mses(pred, x0 - noise, weights)  # (B,), (B,)
        loss = weighted.mean()
        return loss, {"mse": per_sample.detach().mean(), "timesteps": t.detach()}

    def _mean(self, x: torch.Tensor) -> torch.Tensor:
        """The configured ``data_mean`` ``μ`` as ``(1, C, 1, 1, 1)`` for ``x (B, C, d, h, w)``, or a scalar 0 without one."""
        if self.settings.data_mean is None:
            return torch.zeros((), device=x.device)
        return per_channel(self.settings.data_mean, x.shape[1], "data_mean", x.device)

    def add_noise(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """x_t = (1 − t/T)·x₀ + (t/T)·ε (MONAI's ``RFlowScheduler.add_noise``), all ``(B, C, *spatial)``, ``t (B,)``."""
        return self.scheduler.add_noise(x0, noise, t)

    def timestep_at(self, fraction: float) -> float:
        """The timestep at ``fraction`` of the path (0 the data, 1 pure noise): ``fraction·T``, untransformed."""
        return float(min(max(fraction, 0.0), 1.0) * self.num_train_timesteps)

    def to_x0(self, out: torch.Tensor, x: torch.Tensor, t: float) -> torch.Tensor:
        """The x₀ that the UNet's output ``out`` predicts for ``x`` at timestep ``t`` (all ``(B, C, d, h, w)``): ``out``
        itself (``sample``), ``c_skip·x + c_out·out`` (``sample`` with ``sigma_data``: :func:`skip_coefficients`;
        with ``data_mean`` ``μ``, ``μ + c_skip·(x − (1 − s)·μ) + c_out·out``), or
        ``x + s·v̂`` (``velocity``; ``s = t/T``)."""
        s = t / self.num_train_timesteps
        if self.settings.sigma_data is not None:
            at = torch.full((1,), s, device=x.device)
            c_skip, c_out = skip_coefficients(at, self.settings.sigma_data, x.shape[1])
            mean = self._mean(x)  # μ, 0 without data_mean
            return mean + c_skip * (x - (1 - s) * mean) + c_out * out
        return out if self.settings.prediction_type == "sample" else x + s * out

    def sampling_timesteps(self, num_inference_steps: int, numel: int | None = None) -> list[float]:
        """The Euler steps' timesteps in sampling order (the noisiest first) for an encoding of ``numel`` voxels
        (``d·h·w``: the timestep transform shifts them by it; None: the configured ``base_numel``, no shift); the
        scheduler is left set to them."""
        self.scheduler.set_timesteps(num_inference_steps,
                                     input_img_size_numel=self.settings.base_numel if numel is None else numel)
        return [float(t) for t in self.scheduler.timesteps.tolist()]

    @torch.no_grad()
    def sample(
        self,
        model: Callable[..., torch.Tensor],
        shape: tuple[int, ...],
        cond: torch.Tensor | None = None,
        num_inference_steps: int | None = None,
        generator: torch.Generator | None = None,
        device: torch.device | str | None = None,
        eta: float | None = None,
        guidance_scale: float = 1.0,
        covariates: torch.Tensor | None = None,
        guidance_interval: tuple[float, float] | None = None,
        x0_map: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Generate encodings with MONAI's Euler steps from Gaussian noise (arguments as
        :meth:`voxdiff.diffusion.DiffusionProcess.sample`; ``eta`` None: the configured one; above 0, each step
        draws from the path's posterior instead, :func:`flow_step`, with noise from ``generator``; ``x0_map``: applied
        to each step's x̂₀ = x + s·v̂, the step then taken along the velocity of what it returns).

        Returns:
            ``(B, C_out, d, h, w)`` float32 generated x₀ in model range.
        """
        eta = self.settings.eta if eta is None else eta
        if not 0 <= eta <= 1:
            raise ValueError(f"eta={eta}: rectified flow's eta is 0 (Euler) to 1 (ancestral)")
        steps = num_inference_steps or self.settings.num_inference_steps
        device = torch.device(device) if device is not None else (cond.device if cond is not None else "cpu")
        x = torch.randn(tuple(shape), generator=generator, device=device, dtype=torch.float32)
        times = self.sampling_timesteps(steps, _numel(x))
        denoisers = step_denoisers(model, cond, guidance_scale, covariates, times, self.num_train_timesteps,
                                   guidance_interval)
        T = self.num_train_timesteps
        for t, t_next, denoise in zip(times, [*times[1:], 0], denoisers, strict=True):
            out = denoise(x, torch.full((x.shape[0],), float(t), device=device))
            if self.settings.prediction_type == "sample" or x0_map is not None:
                # the velocity of an x̂0 (guidance combined the outputs, which is combining their x̂0s and velocities:
                # both affine in the output at a given x)
                x0 = self.to_x0(out.float(), x, t)
                v = ((x0_map(x0) if x0_map is not None else x0) - x) / (t / T)
            else:
                v = out
            if eta:
                x = flow_step(v, x, t / T, t_next / T, eta, generator)
            else:
                x, _ = self.scheduler.step(v, t, x, t_next)
        return x


def flow_step(v: torch.Tensor, x: torch.Tensor, s: float, s_next: float, eta: float,
              generator: torch.Generator | None = None) -> torch.Tensor:
    """One step of the flow's path from ``x`` at ``s = t/T`` to ``s_next < s`` given the predicted velocity ``v``
    (both ``(B, C, d, h, w)``), DDIM's update with ``eta`` (Song et al. 2021) on the path ``x_s = (1 − s)·x₀ + s·ε``.

    ``x̂₀ = x + s·v`` and ``ε̂ = x − (1 − s)·v``; the next state is ``(1 − s')·x̂₀ + √(s'² − c²)·ε̂ + c·z`` with fresh
    noise ``z`` and ``c = eta·σ``, where ``σ² = s'²·(1 − ((1 − s)·s' / ((1 − s')·s))²)`` is the variance of the
    path's posterior ``q(x_{s'} | x_s, x₀)``. ``eta = 0`` is the Euler step ``x + (s − s')·v``; ``eta = 1`` draws from
    the posterior (ancestral sampling). ``s' = 0`` returns ``x̂₀``.
    """
    x0 = x + s * v
    if s_next <= 0:
        return x0
    eps = x - (1 - s) * v
    ratio = (1 - s) * s_next / ((1 - s_next) * s)  # < 1 for s' < s
    c = eta * s_next * max(0.0, 1 - ratio ** 2) ** 0.5
    z = torch.randn(x.shape, generator=generator, device=x.device, dtype=x.dtype)
    return (1 - s_next) * x0 + (s_next ** 2 - c ** 2) ** 0.5 * eps + c * z


def _numel(x: torch.Tensor) -> int:
    """The voxel count of one encoding ``(B, C, d, h, w)``: d·h·w, what MONAI's transform compares."""
    d, h, w = x.shape[2:]
    return int(d * h * w)
