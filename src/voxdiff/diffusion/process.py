"""The diffusion process: noise schedule, prediction targets, min-SNR weights, the loss of a batch, DDIM sampling.

No Lightning here (STYLE.md, habit 8): the Lightning system calls :meth:`DiffusionProcess.loss` in its
``training_step`` and the preflight traces the same function, so what is predicted is what runs.

Training noises with MONAI's ``DDPMScheduler`` (Ho et al. 2020); sampling runs MONAI's ``DDIMScheduler``
(Song et al. 2021) on the same beta schedule. The UNet predicts one of

* ``epsilon``: the noise ε;
* ``v_prediction``: v = √ᾱ_t·ε − √(1−ᾱ_t)·x₀ (Salimans & Ho 2022);
* ``sample``: x₀ itself.

Min-SNR-γ weighting (Hang et al. 2023, "Efficient Diffusion Training via Min-SNR Weighting Strategy") multiplies
each sample's MSE by a weight of its timestep, with SNR(t) = ᾱ_t / (1 − ᾱ_t):

* ``epsilon``: min(SNR, γ) / SNR
* ``v_prediction``: min(SNR, γ) / (SNR + 1)
* ``sample``: min(SNR, γ)

All of these equal the x₀-space weight min(SNR, γ) once the prediction's error is expressed in x₀ units. The
weights are computed in float64 from the scheduler's ᾱ and stored as float32; the loss is always computed in
float32, whatever the autocast precision of the UNet.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch
from monai.networks.schedulers import DDIMScheduler, DDPMScheduler
from torch import nn

from voxdiff.diffusion.batch import (check_mask_sdf_scale, check_mask_weight, check_pair, model_input,
                                     per_sample_mses)
from voxdiff.diffusion.guidance import step_denoisers
from voxdiff.errors import ConfigError, boolean, integer, number, one_of

PREDICTION_TYPES = ("epsilon", "v_prediction", "sample")
SCHEDULES = ("linear_beta", "scaled_linear_beta", "sigmoid_beta", "cosine")


@dataclass(frozen=True)
class DiffusionSettings:
    """The validated ``diffusion:`` config of DDPM (``configs/diffusion/ddpm.yaml``)."""

    process: str = "ddpm"  # the diffusion process (ddpm | rflow: voxdiff.diffusion.rflow)
    num_train_timesteps: int = 1000
    schedule: str = "scaled_linear_beta"  # a MONAI NoiseSchedules name
    beta_start: float = 0.0015  # ignored by the cosine schedule
    beta_end: float = 0.0195
    prediction_type: str = "epsilon"  # epsilon | v_prediction | sample
    min_snr_gamma: float | None = None  # γ of min-SNR-γ weighting; None = unweighted MSE
    num_inference_steps: int = 50  # DDIM steps when sampling
    eta: float = 0.0  # DDIM stochasticity (0 = deterministic DDIM)
    clip_sample: bool = True  # clip the predicted x0 to the range of encoded volumes while sampling
    mask_weight: float = 0.0  # the loss counts 1 + this where the mask is (voxdiff.diffusion.batch.mask_loss_weights)
    mask_sdf_scale: float | None = None  # seg mode: draw the mask's distance map (batch.mask_distance_map)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def ddpm_settings(cfg: Mapping[str, Any] | None = None, **overrides: Any) -> DiffusionSettings:
    """Validate a plain ``diffusion:`` mapping of DDPM; every failure names the ``diffusion.*`` key, the value and a
    fix (:func:`voxdiff.diffusion.diffusion_settings` picks the process).

    Raises:
        ConfigError: an unknown key or a value that cannot work.
    """
    values = {**dict(cfg or {}), **overrides}
    known = set(DiffusionSettings.__dataclass_fields__)
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"diffusion.{unknown[0]}", values[unknown[0]], "is not a diffusion setting",
                          f"remove it; the settings are {', '.join(sorted(known))}")
    s = DiffusionSettings(**values)
    one_of("diffusion.process", s.process, ("ddpm",))
    t = integer("diffusion.num_train_timesteps", s.num_train_timesteps, minimum=1, example=1000)
    one_of("diffusion.schedule", s.schedule, SCHEDULES)
    number("diffusion.beta_start", s.beta_start, lo=0, hi=1, lo_open=True, example=0.0015)
    number("diffusion.beta_end", s.beta_end, lo=0, hi=1, lo_open=True, example=0.0195)
    if s.schedule != "cosine" and s.beta_end <= s.beta_start:
        raise ConfigError("diffusion.beta_end", s.beta_end, f"must exceed diffusion.beta_start={s.beta_start}",
                          "e.g. beta_start=0.0015, beta_end=0.0195")
    one_of("diffusion.prediction_type", s.prediction_type, PREDICTION_TYPES)
    if s.min_snr_gamma is not None:
        number("diffusion.min_snr_gamma", s.min_snr_gamma, lo=0, lo_open=True,
               fix="use e.g. diffusion.min_snr_gamma=5.0, or null to turn the weighting off")
    steps = integer("diffusion.num_inference_steps", s.num_inference_steps, minimum=1, example=50)
    if steps > t:
        raise ConfigError("diffusion.num_inference_steps", steps,
                          f"DDIM cannot take more steps than the {t} training timesteps",
                          f"use at most {t} (e.g. 50)")
    number("diffusion.eta", s.eta, lo=0, hi=1, fix="use diffusion.eta=0.0 (deterministic DDIM)")
    boolean("diffusion.clip_sample", s.clip_sample, fix="use true")
    check_mask_weight(s.mask_weight)
    check_mask_sdf_scale(s.mask_sdf_scale, s.mask_weight)
    return s


class DiffusionProcess(nn.Module):
    """Forward noising, training targets and loss, and DDIM sampling for one UNet.

    Holds no learned weights: its buffers (ᾱ, the min-SNR weights) are non-persistent, so they move with the
    module to the GPU but are not part of any checkpoint.

    Args:
        settings: the validated DDPM settings (:func:`ddpm_settings`).
        clip_range: while sampling, clip each predicted x₀ to ``[-clip_range, clip_range]`` (the range of encoded
            volumes in model range, :func:`voxdiff.diffusion.encoded_range`); None or ``settings.clip_sample =
            False`` turns clipping off.
    """

    #: the dtype of the ``(B,)`` training timesteps the UNet is called with (what a compiled step is traced for)
    timestep_dtype = torch.int64

    def __init__(self, settings: DiffusionSettings | None = None, clip_range: float | None = None) -> None:
        super().__init__()
        self.settings = settings if settings is not None else DiffusionSettings()
        s = self.settings
        beta_args = {} if s.schedule == "cosine" else {"beta_start": s.beta_start, "beta_end": s.beta_end}
        self.train_scheduler = DDPMScheduler(
            num_train_timesteps=s.num_train_timesteps, schedule=s.schedule, prediction_type=s.prediction_type,
            **beta_args,
        )
        self.clip_range = clip_range if s.clip_sample else None
        self.inference_scheduler = DDIMScheduler(
            num_train_timesteps=s.num_train_timesteps, schedule=s.schedule, prediction_type=s.prediction_type,
            clip_sample=self.clip_range is not None,
            clip_sample_min=-(self.clip_range or 1.0), clip_sample_max=self.clip_range or 1.0,
            **beta_args,
        )
        alphas_cumprod = self.train_scheduler.alphas_cumprod.double()  # (T,)
        snr = alphas_cumprod / (1.0 - alphas_cumprod)
        self.register_buffer("alphas_cumprod", alphas_cumprod.float(), persistent=False)
        self._abar = tuple(alphas_cumprod.tolist())  # ᾱ as floats: sampling reads them wherever the buffers are
        self.register_buffer("snr", snr.float(), persistent=False)
        self.register_buffer("loss_weights", min_snr_weight(snr, s.prediction_type, s.min_snr_gamma).float(),
                             persistent=False)

    @property
    def num_train_timesteps(self) -> int:
        return self.settings.num_train_timesteps

    @property
    def weighted(self) -> bool:
        """Whether the loss weights the MSE (min-SNR-γ, the mask's weight): then the plain MSE is worth logging
        beside it."""
        return self.settings.min_snr_gamma is not None or self.settings.mask_weight > 0

    def sample_timesteps(self, batch: int, device: torch.device, generator: torch.Generator | None = None):
        """Uniform training timesteps ``(B,)`` int64 in ``[0, T)``."""
        return torch.randint(0, self.num_train_timesteps, (batch,), device=device, generator=generator)

    def add_noise(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """x_t = √ᾱ_t·x₀ + √(1−ᾱ_t)·ε (MONAI's ``DDPMScheduler.add_noise``), all ``(B, C, *spatial)`` float32."""
        return self.train_scheduler.add_noise(x0, noise, t)

    def target(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """What the UNet is trained to predict at timesteps ``t`` ``(B,)``, for the configured prediction type."""
        kind = self.settings.prediction_type
        if kind == "epsilon":
            return noise
        if kind == "sample":
            return x0
        return self.train_scheduler.get_velocity(x0, noise, t)  # v = √ᾱ·ε − √(1−ᾱ)·x₀

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
        """The training loss of one batch: THE function that the Lightning system and the preflight both run.

        Draws timesteps and noise, noises ``x0``, concatenates the clean condition along channels, runs the UNet
        (under whatever autocast is active), and returns the (min-SNR weighted) MSE against the target in fp32.

        Args:
            model: the UNet, called as ``model(x, timesteps=t)`` with ``x (B, C_out + C_cond, d, h, w)`` and
                ``t (B,)``; returns ``(B, C_out, d, h, w)``.
            x0: ``(B, C_out, d, h, w)`` the clean encoding to denoise: the image encoding in bravo mode, the mask
                encoding in seg mode (:func:`voxdiff.diffusion.encode_batch`).
            cond: ``(B, C_cond, d, h, w)`` the clean mask encoding (bravo) or None (seg).
            generator: random generator for timesteps and noise (None: the global RNG).
            timesteps: ``(B,)`` fixed timesteps instead of random ones (tests, preflight).
            noise: ``(B, C_out, d, h, w)`` fixed noise instead of random noise.
            weights: ``(B, 1, d, h, w)`` weights of each location's squared error
                (:func:`voxdiff.diffusion.batch.mask_loss_weights`, ``diffusion.mask_weight``); None: unweighted.

        Returns:
            ``(loss, stats)``: ``loss`` a float32 scalar with grad; ``stats`` detached tensors ``mse`` (unweighted
            mean squared error, scalar) and ``timesteps`` ``(B,)``.
        """
        check_pair(x0, cond)
        x0 = x0.float()
        b = x0.shape[0]
        t = timesteps if timesteps is not None else self.sample_timesteps(b, x0.device, generator)
        if noise is None:
            noise = torch.randn(x0.shape, device=x0.device, dtype=torch.float32, generator=generator)
        x_t = self.add_noise(x0, noise, t)  # (B, C_out, d, h, w)
        x_in = model_input(x_t, cond)  # (B, C_out + C_cond, d, h, w)
        pred = model(x_in, timesteps=t).float()  # fp32 from here on, whatever the autocast
        target = self.target(x0, noise, t)
        per_sample, weighted = per_sample_mses(pred, target, weights)  # (B,), (B,)
        loss = (self.loss_weights.to(per_sample.device)[t] * weighted).mean()
        return loss, {"mse": per_sample.detach().mean(), "timesteps": t.detach()}

    def sampling_timesteps(self, num_inference_steps: int, numel: int | None = None) -> list[int]:
        """The DDIM timesteps of ``num_inference_steps`` sampling steps, in sampling order (the noisiest first); the
        inference scheduler is left set to them. ``numel`` (the encoding's voxels) is unused: DDIM's steps do not
        depend on it (rectified flow's do)."""
        self.inference_scheduler.set_timesteps(num_inference_steps)
        return [int(t) for t in self.inference_scheduler.timesteps.tolist()]

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
        """Generate encodings with DDIM, starting from Gaussian noise.

        Args:
            model: the UNet (use the EMA weights), called as in :meth:`loss`.
            shape: ``(B, C_out, d, h, w)`` of the encodings to generate.
            cond: ``(B, C_cond, d, h, w)`` the clean mask encoding (bravo) or None (seg).
            num_inference_steps: DDIM steps (default: the configured ``num_inference_steps``).
            generator: random generator of the initial noise (and of the DDIM noise when ``eta > 0``).
            device: where to generate (default: ``cond``'s device, else the CPU).
            eta: DDIM stochasticity (default: the configured ``eta``).
            guidance_scale: classifier-free guidance (:func:`voxdiff.diffusion.guidance.denoiser`; 1: none).
            covariates: ``(B, K)`` covariate vectors of a model trained with them (None: none).
            guidance_interval: ``[lo, hi]`` fractions of the training schedule (``t / T``) whose steps are guided
                (classifier-free guidance, or ``model``'s autoguidance); the others take the model's conditional
                prediction alone (:func:`voxdiff.diffusion.guidance.step_denoisers`). None: every step.
            x0_map: applied to each step's predicted x₀ ``(B, C_out, d, h, w)`` (after guidance, before DDIM's
                clip), the step then taken from what it returns
                (:func:`voxdiff.diffusion.batch.unweighted_mask_prediction`); None: the prediction as it is.

        Returns:
            ``(B, C_out, d, h, w)`` float32 generated x₀ in model range.
        """
        steps = num_inference_steps or self.settings.num_inference_steps
        eta = self.settings.eta if eta is None else eta
        device = torch.device(device) if device is not None else (cond.device if cond is not None else "cpu")
        scheduler = self.inference_scheduler
        times = self.sampling_timesteps(steps)
        denoisers = step_denoisers(model, cond, guidance_scale, covariates, times, self.num_train_timesteps,
                                   guidance_interval)
        x = torch.randn(tuple(shape), generator=generator, device=device, dtype=torch.float32)
        for t, denoise in zip(times, denoisers, strict=True):
            out = denoise(x, torch.full((x.shape[0],), t, device=device, dtype=torch.long))
            if x0_map is not None:
                out = self.from_x0(x0_map(self.to_x0(out, x, t)), x, t)
            x, _ = scheduler.step(out, t, x, eta=eta, generator=generator)
        return x

    def timestep_at(self, fraction: float) -> int:
        """The training timestep at ``fraction`` of the schedule (0 clean, 1 pure noise): ``round(fraction·T)`` held
        within ``[0, T − 1]``."""
        return min(max(int(round(fraction * self.num_train_timesteps)), 0), self.num_train_timesteps - 1)

    def to_x0(self, out: torch.Tensor, x: torch.Tensor, t: int) -> torch.Tensor:
        """The x₀ that the UNet's output ``out`` predicts for the noisy ``x`` at timestep ``t`` (all ``(B, C, d, h,
        w)``): ``(x − √(1−ᾱ)·ε̂)/√ᾱ``, ``√ᾱ·x − √(1−ᾱ)·v̂``, or ``out`` itself (``sample``)."""
        kind, a = self.settings.prediction_type, self._abar[int(t)]
        if kind == "sample":
            return out
        if kind == "epsilon":
            return (x - (1.0 - a) ** 0.5 * out) / a**0.5
        return a**0.5 * x - (1.0 - a) ** 0.5 * out

    def from_x0(self, x0: torch.Tensor, x: torch.Tensor, t: int) -> torch.Tensor:
        """The inverse of :meth:`to_x0`: the output of the configured prediction type that predicts ``x0`` for the
        noisy ``x`` at timestep ``t`` (ε = (x − √ᾱ·x₀)/√(1−ᾱ), v = √ᾱ·ε − √(1−ᾱ)·x₀)."""
        kind, a = self.settings.prediction_type, self._abar[int(t)]
        if kind == "sample":
            return x0
        eps = (x - a**0.5 * x0) / (1.0 - a) ** 0.5
        return eps if kind == "epsilon" else a**0.5 * eps - (1.0 - a) ** 0.5 * x0


def min_snr_weight(snr: torch.Tensor, prediction_type: str, gamma: float | None) -> torch.Tensor:
    """Per-timestep loss weights of min-SNR-γ (Hang et al. 2023) for the MSE of each prediction type.

    Args:
        snr: SNR(t) = ᾱ_t / (1 − ᾱ_t), any shape.
        prediction_type: ``epsilon`` → min(SNR, γ)/SNR; ``v_prediction`` → min(SNR, γ)/(SNR + 1);
            ``sample`` → min(SNR, γ).
        gamma: γ; None gives weights of one (plain MSE).
    """
    if prediction_type not in PREDICTION_TYPES:
        raise ValueError(f"prediction_type must be one of {PREDICTION_TYPES}, got {prediction_type!r}")
    if gamma is None:
        return torch.ones_like(snr)
    clipped = torch.clamp(snr, max=gamma)
    if prediction_type == "epsilon":
        return clipped / snr
    if prediction_type == "v_prediction":
        return clipped / (snr + 1.0)
    return clipped
