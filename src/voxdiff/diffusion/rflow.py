"""Rectified flow (Liu et al. 2023; Esser et al. 2024), on MONAI's ``RFlowScheduler``: ``diffusion=rflow``.

MONAI's convention, used throughout (``monai.networks.schedulers.rectified_flow``), with ``t ∈ [0, T]``::

    x_t = (1 − t/T)·x₀ + (t/T)·ε          (t = T: pure noise; t → 0: the data)
    v   = x₀ − ε                           the velocity the UNet is trained to predict (plain MSE)
    x_{t'} = x_t + v̂·(t − t')/T           one Euler step towards the data (t' < t)

Training timesteps are drawn uniformly or logit-normally (Esser et al. 2024, "Scaling Rectified Flow
Transformers"), rounded to MONAI's discrete grid, then — with ``timestep_transform`` — shifted by MONAI's
resolution-dependent transform towards the noisy end for encodings with more voxels than ``base_numel`` (a volume
of more voxels keeps its structure under more noise; MAISI v2 trains so). Sampling takes MONAI's Euler steps over
``num_inference_steps`` (30 by default, as MAISI v2) on the same transformed grid.

The settings of DDPM that mean nothing here (``min_snr_gamma``, the beta schedule, ``eta``, ``clip_sample``, a
prediction type other than the velocity) are refused with the fix, not silently ignored.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch
from monai.networks.schedulers import RFlowScheduler
from monai.networks.schedulers.rectified_flow import timestep_transform
from torch import nn

from voxdiff.diffusion.batch import check_mask_weight, check_pair, per_sample_mses
from voxdiff.diffusion.guidance import step_denoisers
from voxdiff.errors import ConfigError, boolean, integer, number, one_of

TIMESTEP_SAMPLING = ("uniform", "logit-normal")
#: DDPM's settings, and why each means nothing for rectified flow (``configs/diffusion/rflow.yaml`` holds them as
#: null, so that ``diffusion.<key>=...`` on the command line reaches this message)
NOT_FOR_RFLOW = {
    "min_snr_gamma": "rectified flow's loss is the plain velocity MSE; there is no SNR weighting to set",
    "schedule": "rectified flow interpolates linearly between data and noise; there is no beta schedule",
    "beta_start": "rectified flow interpolates linearly between data and noise; there are no betas",
    "beta_end": "rectified flow interpolates linearly between data and noise; there are no betas",
    "eta": "rectified flow samples with deterministic Euler steps; there is no DDIM eta",
    "clip_sample": "rectified flow's Euler steps do not predict x0 to clip",
}


@dataclass(frozen=True)
class RFlowSettings:
    """The validated ``diffusion:`` config of rectified flow (``configs/diffusion/rflow.yaml``)."""

    process: str = "rflow"
    num_train_timesteps: int = 1000  # T: the timestep range [0, T] the UNet's embedding sees
    prediction_type: str = "velocity"  # v = x0 − ε, the only target of rectified flow
    timestep_sampling: str = "logit-normal"  # uniform | logit-normal (sigmoid of N(loc, scale))
    logit_normal_loc: float = 0.0
    logit_normal_scale: float = 1.0
    timestep_transform: bool = True  # MONAI's resolution-dependent shift of the timesteps
    base_numel: int = 32 * 32 * 32  # the voxel count of the encoding at which the transform is the identity
    num_inference_steps: int = 30  # Euler steps when sampling
    mask_weight: float = 0.0  # the loss counts 1 + this where the mask is (voxdiff.diffusion.batch.mask_loss_weights)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def rflow_settings(cfg: Mapping[str, Any] | None = None, **overrides: Any) -> RFlowSettings:
    """Validate a plain ``diffusion:`` mapping of rectified flow; every failure names the key, the value and a fix.

    Raises:
        ConfigError: an unknown key, a DDPM setting that is set (:data:`NOT_FOR_RFLOW`), or a value that cannot work.
    """
    values = {**dict(cfg or {}), **overrides}
    for key, why in NOT_FOR_RFLOW.items():
        if values.pop(key, None) is not None:
            raise ConfigError(f"diffusion.{key}", cfg.get(key) if cfg else overrides.get(key), why,
                              f"remove diffusion.{key} (or set it to null), or use diffusion=ddpm")
    known = set(RFlowSettings.__dataclass_fields__)
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"diffusion.{unknown[0]}", values[unknown[0]], "is not a rectified-flow setting",
                          f"remove it; the settings are {', '.join(sorted(known))}")
    if values.get("prediction_type", "velocity") != "velocity":
        raise ConfigError("diffusion.prediction_type", values["prediction_type"],
                          "rectified flow predicts the velocity x0 − noise, nothing else",
                          "use diffusion.prediction_type=velocity, or diffusion=ddpm for epsilon, v_prediction or "
                          "sample")
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
    check_mask_weight(s.mask_weight)
    return s


class RectifiedFlow(nn.Module):
    """Rectified-flow training loss and Euler sampling for one UNet: the same interface as
    :class:`voxdiff.diffusion.DiffusionProcess` (``loss``, ``sample``, ``num_train_timesteps``, ``weighted``,
    ``settings``).

    Args:
        settings: :func:`rflow_settings`.
        clip_range: unused (rectified flow does not clip); accepted so that every process is built alike.
    """

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
        returns): the MSE of the predicted velocity against ``x0 − noise`` in fp32.

        ``timesteps`` given (the validation loss's fixed grid) are used as they are, untransformed.
        """
        check_pair(x0, cond)
        x0 = x0.float()
        t = timesteps.float() if timesteps is not None else self.sample_timesteps(x0, generator)  # (B,)
        if noise is None:
            noise = torch.randn(x0.shape, device=x0.device, dtype=torch.float32, generator=generator)
        x_t = self.scheduler.add_noise(x0, noise, t)  # (1 − t/T)·x0 + (t/T)·ε, (B, C_out, d, h, w)
        x_in = x_t if cond is None else torch.cat([x_t, cond.to(x_t.dtype)], dim=1)  # (B, C_out + C_cond, ...)
        pred = model(x_in, timesteps=t).float()
        target = x0 - noise
        per_sample, weighted = per_sample_mses(pred, target, weights)  # (B,), (B,)
        loss = weighted.mean()
        return loss, {"mse": per_sample.detach().mean(), "timesteps": t.detach()}

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
    ) -> torch.Tensor:
        """Generate encodings with MONAI's Euler steps from Gaussian noise (arguments as
        :meth:`voxdiff.diffusion.DiffusionProcess.sample`; ``eta`` must be None or 0: the steps are deterministic).

        Returns:
            ``(B, C_out, d, h, w)`` float32 generated x₀ in model range.
        """
        if eta:
            raise ValueError(f"rectified flow samples deterministically: eta={eta} means nothing here")
        steps = num_inference_steps or self.settings.num_inference_steps
        device = torch.device(device) if device is not None else (cond.device if cond is not None else "cpu")
        x = torch.randn(tuple(shape), generator=generator, device=device, dtype=torch.float32)
        times = self.sampling_timesteps(steps, _numel(x))
        denoisers = step_denoisers(model, cond, guidance_scale, covariates, times, self.num_train_timesteps,
                                   guidance_interval)
        for t, t_next, denoise in zip(times, [*times[1:], 0], denoisers, strict=True):
            v = denoise(x, torch.full((x.shape[0],), float(t), device=device))
            x, _ = self.scheduler.step(v, t, x, t_next)
        return x


def _numel(x: torch.Tensor) -> int:
    """The voxel count of one encoding ``(B, C, d, h, w)``: d·h·w, what MONAI's transform compares."""
    d, h, w = x.shape[2:]
    return int(d * h * w)
