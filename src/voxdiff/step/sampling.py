"""``system.sampling`` and ``system.val_timesteps``: what the diffusion system samples and validates during
training, validated before anything is built (Lightning-free: the run spec and the preflight read it too)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from voxdiff.errors import ConfigError, boolean, integer, settings_from


@dataclass(frozen=True)
class SamplingSettings:
    """``system.sampling``: samples conditioned on validation masks during training."""

    every_n_epochs: int = 10  # 0: never (besides the end of training when final is true)
    num_masks: int = 2  # validation masks to sample from
    num_inference_steps: int | None = None  # DDIM steps; None = diffusion.num_inference_steps
    seed: int = 0  # generator seed of the validation noise and of the sampling noise (same every epoch)
    final: bool = True  # also sample when training ends


def sampling_settings(sampling: Mapping[str, Any] | None, val_timesteps: Any = 4) -> SamplingSettings:
    """Validate ``system.sampling`` (a plain mapping; None: the defaults) and ``system.val_timesteps``.

    Raises:
        ConfigError: naming the key, the value and a fix.
    """
    s = settings_from(SamplingSettings, "system.sampling", sampling)
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
    return s
