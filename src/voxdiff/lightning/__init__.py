"""Lightning systems and their parts: the diffusion system (and the VQ-VAE stage-1 system), EMA, atomic
checkpoints, callbacks, the optimizer factory shared with the preflight, and the Trainer factory.
"""

from __future__ import annotations

from typing import Any

from voxdiff.lightning.callbacks import ConfigInCheckpoint, HoldAtStep, LastCheckpoint, PoisonBatch, StepsPerSecond
from voxdiff.lightning.checkpoint_io import AtomicCheckpointIO, atomic_torch_save
from voxdiff.lightning.diffusion import DiffusionSystem, NonFiniteLossError, system_settings
from voxdiff.lightning.ema import EMA
from voxdiff.lightning.optim import OptimSettings, WarmupCosine, build_lr_scheduler, build_optimizer, optim_settings
from voxdiff.lightning.trainer import build_trainer, resolve_precision

__all__ = [
    "EMA",
    "AtomicCheckpointIO",
    "ConfigInCheckpoint",
    "DiffusionSystem",
    "HoldAtStep",
    "LastCheckpoint",
    "NonFiniteLossError",
    "OptimSettings",
    "PoisonBatch",
    "StepsPerSecond",
    "VQVAESystem",
    "WarmupCosine",
    "atomic_torch_save",
    "build_lr_scheduler",
    "build_optimizer",
    "build_trainer",
    "optim_settings",
    "resolve_precision",
    "system_settings",
]


def __getattr__(name: str) -> Any:
    # the stage-1 system lives in its own module (configs/system/vqvae.yaml: voxdiff.lightning.VQVAESystem)
    if name == "VQVAESystem":
        from voxdiff.lightning.vqvae import VQVAESystem

        return VQVAESystem
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
