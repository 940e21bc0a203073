"""Lightning systems and their parts: the diffusion system (and the VQ-VAE stage-1 system), atomic checkpoints,
callbacks and the Trainer factory. The training step they drive (optimizer, EMA, clipping, precision) is
:mod:`voxdiff.step`, which knows nothing of Lightning.
"""

from __future__ import annotations

from voxdiff.files import atomic_torch_save
from voxdiff.lightning.callbacks import (
    ConfigInCheckpoint,
    ExhaustMemory,
    FailurePoint,
    HoldAtStep,
    LastCheckpoint,
    PoisonBatch,
    ProgressBar,
    StepsPerSecond,
)
from voxdiff.lightning.checkpoint_io import AtomicCheckpointIO
from voxdiff.lightning.diffusion import DiffusionSystem, NonFiniteLossError
from voxdiff.lightning.trainer import build_trainer, resolve_precision
from voxdiff.lightning.vqvae import VQVAESystem

__all__ = [
    "AtomicCheckpointIO",
    "ConfigInCheckpoint",
    "DiffusionSystem",
    "ExhaustMemory",
    "FailurePoint",
    "HoldAtStep",
    "LastCheckpoint",
    "NonFiniteLossError",
    "PoisonBatch",
    "ProgressBar",
    "StepsPerSecond",
    "VQVAESystem",
    "atomic_torch_save",
    "build_trainer",
    "resolve_precision",
]

