"""What a system's ``configure_optimizers`` returns: the optimizer and its per-step schedule in Lightning's format.

The optimizer and the schedule themselves are made by :mod:`voxdiff.step.optim` (no Lightning there).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from voxdiff.step.optim import OptimSettings, build_lr_scheduler, build_optimizer


def lightning_optimizers(optimizer: torch.optim.Optimizer,
                         scheduler: torch.optim.lr_scheduler.LRScheduler) -> dict[str, Any]:
    """``{"optimizer", "lr_scheduler"}`` with the schedule stepped after every optimizer step and logged as ``lr``."""
    return {"optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1, "name": "lr"}}


def configure_adamw(params: Iterable[torch.nn.Parameter], settings: OptimSettings,
                    estimated_stepping_batches: float) -> dict[str, Any]:
    """AdamW over ``params`` and the warm-up/cosine schedule over ``trainer.estimated_stepping_batches``.

    Raises:
        ConfigError: an unbounded run without ``system.optim.decay_steps`` (the cosine would have no end).
    """
    optimizer = build_optimizer(params, settings)
    return lightning_optimizers(optimizer, build_lr_scheduler(optimizer, settings, estimated_stepping_batches))


def unscale_before_clipping(trainer: Any, optimizer: torch.optim.Optimizer) -> None:
    """Under a loss scaler (fp16), bring the gradients back to their own scale before a system clips them.

    Lightning unscales them before the clipping hook only for an optimizer that does not unscale them itself in its
    step; a fused AdamW (the default on a GPU) does, so they reach ``configure_gradient_clipping`` multiplied by the
    loss scale, and a clip value would be measured against the scaled norm. Unscaled here, the scaler's step then
    hands the optimizer no scale of its own. A no-op without a scaler or for an optimizer Lightning unscaled.
    """
    scaler = getattr(getattr(trainer, "precision_plugin", None), "scaler", None)
    if scaler is not None and getattr(optimizer, "_step_supports_amp_scaling", False):
        scaler.unscale_(optimizer)

