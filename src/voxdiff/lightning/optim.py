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
