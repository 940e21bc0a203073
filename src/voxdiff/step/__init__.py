"""The training step, written once and free of Lightning (``import voxdiff.step`` never imports it).

* :mod:`~voxdiff.step.train_step`: :class:`TrainStep` — the loss of a batch, the gradient order, clipping and the
  non-finite guard, the post-step hooks (EMA), driven by Lightning, traced by the preflight, run by the measure
  mode;
* :mod:`~voxdiff.step.recipe`: :class:`Recipe` — what a step is made of, by name: ``system`` (``train.py``'s
  step for a config) and ``seed`` (the step of the reference measurements);
* :mod:`~voxdiff.step.optim`: AdamW from ``system.optim`` and its implementation (foreach / fused / single), the
  warm-up/cosine schedule;
* :mod:`~voxdiff.step.ema`: the EMA of the weights;
* :mod:`~voxdiff.step.guard`: the non-finite guard, recorded on the device and checked every N steps and before
  every checkpoint;
* :mod:`~voxdiff.step.compiling`: ``torch.compile`` of the training forward (``model.compile``);
* :mod:`~voxdiff.step.precision`: :func:`decide_precision`, the one decision of ``trainer.precision`` on a device.
"""

from voxdiff.step.compiling import CompiledForward, CompileFailed, CompileSettings
from voxdiff.step.ema import EMA, EMASettings, ema_settings
from voxdiff.step.guard import FiniteGuard, GuardSettings, NonFiniteLossError, guard_settings
from voxdiff.step.optim import (
    OptimSettings,
    WarmupCosine,
    build_lr_scheduler,
    build_optimizer,
    optim_settings,
    optimizer_impl,
    params_device_type,
)
from voxdiff.step.precision import Precision, accelerator_device, decide_precision
from voxdiff.step.recipe import (
    RECIPES,
    SEED,
    ClipSettings,
    Recipe,
    clip_settings,
    recipe_from_config,
    system_recipe,
)
from voxdiff.step.train_step import PhaseProbe, TrainStep, batch_shapes

__all__ = [
    "EMA",
    "RECIPES",
    "SEED",
    "ClipSettings",
    "CompileFailed",
    "CompileSettings",
    "CompiledForward",
    "EMASettings",
    "FiniteGuard",
    "GuardSettings",
    "NonFiniteLossError",
    "OptimSettings",
    "PhaseProbe",
    "Precision",
    "Recipe",
    "TrainStep",
    "WarmupCosine",
    "accelerator_device",
    "batch_shapes",
    "build_lr_scheduler",
    "build_optimizer",
    "clip_settings",
    "decide_precision",
    "ema_settings",
    "guard_settings",
    "optim_settings",
    "optimizer_impl",
    "params_device_type",
    "recipe_from_config",
    "system_recipe",
]
