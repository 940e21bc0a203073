"""Named recipes of a training step: what decides its numerics and its memory, apart from the model.

A :class:`Recipe` is plain data: the loss (voxdiff's diffusion loss with its settings, or the seed's loss), the
optimizer settings, the gradient order, clipping, the non-finite guard and the EMA. Two are named:

* ``system`` — the step ``train.py`` runs, read from a run config by :func:`system_recipe`: the configured
  diffusion loss, ``system.optim``, gradients freed right after the optimizer step, ``trainer.gradient_clip_val``,
  the guard on the loss and the gradient norm (``system.guard``), ``system.ema``;
* ``seed`` — :data:`SEED`, the step the reference measurements (``reference/h100_measured.csv``) ran: the seed's
  loss (:func:`voxdiff.diffusion.seed.seed_loss`), foreach AdamW, gradients freed after the forward and before
  backward (Lightning's automatic order), no EMA, no clipping, no guard.

The preflight takes one by name: ``preflight.recipe`` in the config, or a ``recipe`` column in a sweep CSV.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig

from voxdiff.config import select
from voxdiff.diffusion import DiffusionSettings, GuidanceSettings, RFlowSettings, diffusion_settings, guidance_settings
from voxdiff.errors import ConfigError, number
from voxdiff.step.ema import EMASettings, ema_settings
from voxdiff.step.guard import GuardSettings, guard_settings
from voxdiff.step.optim import OptimSettings, optim_settings

ZERO_GRAD_AT = ("before_backward", "after_step")
CLIP_ALGORITHMS = ("norm", "value")
RECIPES = ("system", "seed")


@dataclass(frozen=True)
class ClipSettings:
    """``trainer.gradient_clip_val`` / ``trainer.gradient_clip_algorithm``: clip the gradients' total norm (or
    each gradient element) to ``value`` before the optimizer step."""

    value: float
    algorithm: str = "norm"


def clip_settings(value: Any, algorithm: Any = "norm") -> ClipSettings | None:
    """Validate ``trainer.gradient_clip_val`` (null or 0: no clipping) and ``trainer.gradient_clip_algorithm``.

    Raises:
        ConfigError: naming the key, the value and a fix.
    """
    algorithm = "norm" if algorithm is None else str(getattr(algorithm, "value", algorithm)).lower()  # str or enum
    if algorithm not in CLIP_ALGORITHMS:
        raise ConfigError("trainer.gradient_clip_algorithm", algorithm, "is not a clipping algorithm",
                          "use norm or value")
    if value is None or value == 0:
        return None
    value = number("trainer.gradient_clip_val", value, lo=0, lo_open=True,
                   fix="e.g. trainer.gradient_clip_val=1.0, or null for no clipping")
    return ClipSettings(value, algorithm)


@dataclass(frozen=True)
class Recipe:
    """How a training step runs, apart from the model and the data.

    Attributes:
        name: ``system`` or ``seed`` (:data:`RECIPES`).
        optim: AdamW settings (its implementation follows from them and the device: ``optimizer_impl``).
        zero_grad_at: when the previous step's gradients are freed: ``before_backward`` (after the forward, as
            Lightning's automatic optimisation does) or ``after_step`` (right after ``optimizer.step()``, so they
            are not alive through the next forward).
        clip: gradient clipping, or None.
        guard: record a non-finite loss or gradient norm on the device and stop on it, checked every
            ``check_every_n_steps`` and before every checkpoint (:mod:`voxdiff.step.guard`); None: no guard.
        ema: EMA of the weights updated after every optimizer step, or None.
        diffusion: the settings of the diffusion process whose loss it is (DDPM or rectified flow:
            :func:`voxdiff.diffusion.diffusion_settings`); None: the seed's loss.
        guidance: condition dropout for classifier-free guidance (:mod:`voxdiff.diffusion.guidance`); None: none.
    """

    name: str
    optim: OptimSettings
    zero_grad_at: str
    clip: ClipSettings | None
    guard: GuardSettings | None
    ema: EMASettings | None
    diffusion: DiffusionSettings | RFlowSettings | None
    guidance: GuidanceSettings | None = None

    def __post_init__(self) -> None:
        if self.zero_grad_at not in ZERO_GRAD_AT:
            raise ValueError(f"zero_grad_at={self.zero_grad_at!r}: use one of {', '.join(ZERO_GRAD_AT)}")


SEED = Recipe(
    name="seed",
    # AdamW(foreach=True) over one parameter group, as measured. The reference ran torch's default weight decay
    # (0.01 on every parameter): an in-place update that changes no byte. Here it is 0, because voxdiff's
    # optimizer factory splits decayed and undecayed parameters into two groups, and foreach AdamW's temporary
    # spans one group at a time, which would lower the optimizer-step peak below the measured one.
    optim=OptimSettings(lr=1e-4, weight_decay=0.0, foreach=True),
    zero_grad_at="before_backward",
    clip=None,
    guard=None,
    ema=None,
    diffusion=None,
)
"""The step of ``reference/h100_measured.csv`` (see the module docstring)."""


def system_recipe(
    optim: Mapping[str, Any] | None,
    ema: Mapping[str, Any] | bool | None,
    diffusion: Mapping[str, Any] | None,
    clip: ClipSettings | None = None,
    guard: Mapping[str, Any] | None = None,
    guidance: Mapping[str, Any] | None = None,
    mode: str = "bravo",
) -> Recipe:
    """The step of the diffusion system from plain ``system.optim``, ``system.ema``, ``diffusion``, ``system.guard``,
    ``system.guidance`` mappings (for ``mode``) and the trainer's clipping (validated here; raises ConfigError)."""
    drop = guidance_settings(guidance, mode)
    return Recipe(
        name="system",
        optim=optim_settings(optim),
        zero_grad_at="after_step",  # Lightning would keep them through the next forward: 4 B per parameter
        clip=clip,
        guard=guard_settings(guard),
        ema=ema_settings(ema),
        diffusion=diffusion_settings(diffusion or {}),
        guidance=drop if drop.drop_prob > 0 else None,
    )


def recipe_from_config(cfg: DictConfig, name: str | None = None) -> Recipe:
    """The recipe ``name`` (default: ``preflight.recipe``; null or absent: ``system``) for a run config.

    Raises:
        ConfigError: an unknown name, or a ``system`` setting that cannot work.
    """
    name = name if name is not None else (select(cfg, "preflight.recipe") or "system")
    if name == "seed":
        return SEED
    if name != "system":
        raise ConfigError("preflight.recipe", name, "is not a training-step recipe",
                          "use system (the step train.py runs for this config) or seed (the step of the reference "
                          "measurements)")
    clip = clip_settings(select(cfg, "trainer.gradient_clip_val"), select(cfg, "trainer.gradient_clip_algorithm"))
    return system_recipe(select(cfg, "system.optim"), select(cfg, "system.ema"), select(cfg, "diffusion"), clip,
                         select(cfg, "system.guard"), select(cfg, "system.guidance"), select(cfg, "mode", "bravo"))
