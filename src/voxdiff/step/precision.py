"""The precision of a training step, decided in one place from the config and the device.

``trainer.precision`` takes ``null`` (the device decides: ``bf16-mixed`` on a CUDA GPU that has bf16, ``16-mixed``
on one that has not, ``32-true`` on the CPU), ``32-true``, ``bf16-mixed`` or ``16-mixed`` (and Lightning's short
forms ``32``, ``bf16``, ``16``). :func:`decide_precision` is the only function that reads it: the Trainer factory,
the preflight (for the GPU it predicts) and the sampler (for the device it samples on, with the precision saved in
the checkpoint) all call it, so the step that trains, the step that is traced and the sampling run agree.

A :class:`Precision` opens the autocast region of the forward pass and runs the backward pass
(:meth:`Precision.context`); the preflight replaces that runtime part by its CUDA-autocast emulator.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from voxdiff.errors import ConfigError

PRECISIONS = ("32-true", "bf16-mixed", "16-mixed")
_ALIASES = {"32": "32-true", "32-true": "32-true", "bf16": "bf16-mixed", "bf16-mixed": "bf16-mixed",
            "16": "16-mixed", "16-mixed": "16-mixed"}  # fmt: skip
#: the autocast dtype of each precision (None: full fp32, no autocast)
AUTOCAST_DTYPES = {"32-true": None, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


def accelerator_device(accelerator: Any) -> str:
    """``trainer.accelerator`` → the device type the run uses: ``cuda`` (``gpu``, ``cuda``, or ``auto`` with a
    CUDA GPU present) or ``cpu``."""
    accelerator = str(accelerator or "auto").lower()
    if accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available()):
        return "cuda"
    return "cpu"


def _local_bf16() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_bf16_supported()


def cpu_has_native_bf16() -> bool:
    """Whether this CPU runs bf16 in hardware (AVX512-BF16 or AMX, through oneDNN): there ``bf16-mixed`` speeds the
    CPU step up (the demo's step 1.75× on an AMD EPYC with AVX512-BF16, ``docs/demo_recipe.md``); elsewhere autocast
    emulates bf16 and is slower than ``32-true``."""
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a build without oneDNN
        return False


@dataclass(frozen=True)
class Precision:
    """A decided precision: Lightning's name for it and the device type its autocast runs on.

    Attributes:
        name: ``32-true``, ``bf16-mixed`` or ``16-mixed`` (what ``lightning.Trainer(precision=...)`` takes).
        device_type: ``cuda`` or ``cpu``.
    """

    name: str
    device_type: str

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """The lower-precision dtype of autocast, None for full fp32."""
        return AUTOCAST_DTYPES[self.name]

    @property
    def scales_loss(self) -> bool:
        """fp16 AMP on a GPU scales the loss (``GradScaler``); inf gradients are then expected and skipped."""
        return self.name == "16-mixed" and self.device_type == "cuda"

    def autocast(self) -> Any:
        """``torch.autocast`` for this precision (disabled for ``32-true``)."""
        dtype = self.autocast_dtype
        return nullcontext() if dtype is None else torch.autocast(self.device_type, dtype=dtype)

    def context(self) -> PrecisionContext:
        """The runtime part of a training step: autocast around the forward, (scaled) backward, optimizer step."""
        return AutocastContext(self)


def decide_precision(requested: Any, device_type: str, bf16_supported: bool | None = None) -> Precision:
    """THE precision decision of voxdiff: ``trainer.precision`` on a device.

    Args:
        requested: ``trainer.precision`` (None/null, or a name of :data:`PRECISIONS` or its short form).
        device_type: ``cuda`` or ``cpu`` (see :func:`accelerator_device`).
        bf16_supported: whether the GPU has bf16; None asks the local GPU (the preflight passes the answer for
            the GPU it predicts when there is none).

    Raises:
        ConfigError: an unknown precision, bf16 on a GPU without it, or fp16 AMP on the CPU.
    """
    if device_type not in ("cuda", "cpu"):
        raise ValueError(f"device_type={device_type!r}: use 'cuda' or 'cpu'")
    if requested is None:
        if device_type == "cpu":
            return Precision("32-true", "cpu")
        bf16 = _local_bf16() if bf16_supported is None else bf16_supported
        return Precision("bf16-mixed" if bf16 else "16-mixed", "cuda")
    name = _ALIASES.get(str(requested))
    if name is None:
        raise ConfigError("trainer.precision", requested, "is not a precision voxdiff trains, samples and predicts",
                          "use null (bf16-mixed on a GPU with bf16, 16-mixed on an older GPU, 32-true on the CPU), "
                          "32-true, bf16-mixed or 16-mixed")
    if name == "bf16-mixed" and device_type == "cuda":
        bf16 = _local_bf16() if bf16_supported is None else bf16_supported
        if not bf16:
            raise ConfigError("trainer.precision", requested, "this GPU has no bf16",
                              "use trainer.precision=16-mixed or null (16-mixed on such a GPU)")
    if name == "16-mixed" and device_type == "cpu":
        raise ConfigError("trainer.precision", requested, "fp16 AMP needs a CUDA GPU",
                          "use trainer.precision=32-true (or bf16-mixed) on the CPU, or null")
    return Precision(name, device_type)


class PrecisionContext(Protocol):
    """What a training step needs from its precision: the forward region, the backward, the optimizer step."""

    def forward(self) -> Any:
        """Context manager around the loss of a batch (the autocast region)."""

    def backward(self, loss: torch.Tensor) -> None:
        """Gradients of ``loss``."""

    def unscale(self, optimizer: Any) -> None:
        """Bring the gradients back to their true scale before clipping (a no-op without loss scaling)."""

    def step(self, optimizer: Any) -> None:
        """``optimizer.step()`` (skipped by a loss scaler when the gradients are not finite)."""

    @property
    def scales_loss(self) -> bool:
        """Whether non-finite gradients are expected and skipped by a loss scaler."""


class AutocastContext:
    """The real :class:`PrecisionContext`: ``torch.autocast`` and, for fp16 on a GPU, a ``GradScaler``."""

    def __init__(self, precision: Precision) -> None:
        self.precision = precision
        self.scaler = torch.amp.GradScaler("cuda") if precision.scales_loss else None

    @property
    def scales_loss(self) -> bool:
        return self.scaler is not None

    @contextmanager
    def forward(self) -> Iterator[None]:
        with self.precision.autocast():
            yield

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def unscale(self, optimizer: Any) -> None:
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: Any) -> None:
        if self.scaler is None:
            optimizer.step()
        else:
            self.scaler.step(optimizer)
            self.scaler.update()
