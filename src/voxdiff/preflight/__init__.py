"""Preflight: predict the GPU memory of a training step without a GPU.

The entry point is :func:`predict_step_memory`, which traces one real training step of the model on the
``meta`` device (CUDA autocast and FlashAttention emulated) and returns a :class:`MemoryReport`.
:func:`voxdiff.preflight.sweep.sweep` runs it over a CSV of UNet configurations.
"""

from voxdiff.preflight.memory import (
    DEFAULT_SAFETY_MARGIN,
    MemoryReport,
    StepPeaks,
    diffusion_loss,
    predict_step_memory,
)

__all__ = ["DEFAULT_SAFETY_MARGIN", "MemoryReport", "StepPeaks", "diffusion_loss", "predict_step_memory"]
