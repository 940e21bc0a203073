"""Preflight: predict the GPU memory of a training step without a GPU (no Lightning imported: it runs on a login
node).

The entry point is :func:`predict_step_memory`, which traces the training step (:class:`voxdiff.step.TrainStep`
of a named :class:`voxdiff.step.Recipe`) of a model on the ``meta`` device (CUDA autocast and FlashAttention
emulated) and returns a :class:`MemoryReport`; with ``compile=True`` the model runs as ``torch.compile`` would run it
(:mod:`voxdiff.preflight.compiled`). :func:`voxdiff.preflight.memory.predict_memory` does it for a run
spec, :func:`voxdiff.benchmarks.sweep.sweep` over a CSV of UNet configurations.
"""

from voxdiff.preflight.memory import (
    DEFAULT_SAFETY_MARGIN,
    MemoryReport,
    StepPeaks,
    predict_step_memory,
)

__all__ = ["DEFAULT_SAFETY_MARGIN", "MemoryReport", "StepPeaks", "predict_step_memory"]
