"""The diffusion processes by name (``diffusion.process``): their settings and their class, looked up in one place.

* ``ddpm``: DDPM training, DDIM sampling (:class:`voxdiff.diffusion.DiffusionProcess`, ``configs/diffusion/ddpm.yaml``);
* ``rflow``: rectified flow, Euler sampling (:class:`voxdiff.diffusion.rflow.RectifiedFlow`,
  ``configs/diffusion/rflow.yaml``).

Both have the same interface: ``loss(model, x0, cond, generator, timesteps, noise)``, ``sample(model, shape, cond,
num_inference_steps, generator, device, eta, guidance_scale)``, ``num_train_timesteps``, ``weighted`` (whether the
loss weights its MSE) and ``settings``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Union

import torch

from voxdiff.diffusion.process import DiffusionProcess, DiffusionSettings, ddpm_settings
from voxdiff.diffusion.rflow import RectifiedFlow, RFlowSettings, rflow_settings
from voxdiff.errors import one_of

PROCESSES = {"ddpm": (ddpm_settings, DiffusionProcess), "rflow": (rflow_settings, RectifiedFlow)}
AnySettings = Union[DiffusionSettings, RFlowSettings]
Process = Union[DiffusionProcess, RectifiedFlow]


def diffusion_settings(cfg: Mapping[str, Any] | None = None, **overrides: Any) -> AnySettings:
    """Validate a plain ``diffusion:`` mapping for its ``process`` (absent: ``ddpm``, as every config before
    rectified flow); every failure names the ``diffusion.*`` key, the value and a fix.

    Raises:
        ConfigError: an unknown process, or what that process's settings refuse.
    """
    values = {**dict(cfg or {}), **overrides}
    name = one_of("diffusion.process", values.get("process", "ddpm"), tuple(PROCESSES))
    return PROCESSES[name][0](values)


def timestep_dtype(settings: AnySettings | None) -> torch.dtype:
    """The dtype of the training timesteps the UNet is called with for ``settings`` (None: the seed recipe's loss,
    int64 as DDPM's)."""
    return PROCESSES[settings.process][1].timestep_dtype if settings is not None else torch.int64


def build_process(settings: AnySettings, clip_range: float | None = None) -> Process:
    """The process of validated ``settings`` (``clip_range``: DDIM's x₀ clipping, unused by rectified flow)."""
    return PROCESSES[settings.process][1](settings, clip_range=clip_range)
