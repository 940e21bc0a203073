"""The device a command without a run config runs on (``sample.py``, ``evaluate.py``, ``cache_latents.py``:
``device=auto|cpu|cuda``), chosen in one place. ``train.py`` takes its device from ``trainer.accelerator``
(:func:`voxdiff.step.accelerator_device`)."""

from __future__ import annotations

from typing import Any

from voxdiff.errors import ConfigError, one_of

#: the values of a command's ``device`` key
DEVICES = ("auto", "cpu", "cuda")


def check_device(name: Any, key: str = "device") -> str:
    """``name`` if this machine can run it: one of :data:`DEVICES`, and ``cuda`` only where a CUDA GPU is visible.

    Raises:
        ConfigError: naming ``key``, the value and a fix.
    """
    import torch

    one_of(key, name, DEVICES)
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError(key, name, "no CUDA GPU is visible", f"use {key}=auto or {key}=cpu")
    return name


def pick_device(name: Any, key: str = "device") -> Any:
    """The ``torch.device`` of ``name`` (:func:`check_device`): ``auto`` is the CUDA GPU when one is visible, else
    the CPU."""
    import torch

    name = check_device(name, key)
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)
