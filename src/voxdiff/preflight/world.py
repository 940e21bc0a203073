"""The traced world of every prediction, set up once: meta tensors standing for a GPU, CUDA autocast emulated, the
allocator's bookkeeping, and a training step (or a stage-1 optimizer) whose optimizer runs on meta.

The step's trace (:mod:`voxdiff.preflight.memory`), validation and sampling (:mod:`voxdiff.preflight.phases`) and
stage 1 (:mod:`voxdiff.preflight.stage1`) each run the system's own code inside it:

* :func:`emulated_precision`: the precision context of a traced step, :class:`EmulatedPrecision` around a
  :class:`~voxdiff.preflight.autocast.CudaAutocastEmulator` of the run's precision (the dtypes of
  :data:`voxdiff.step.precision.AUTOCAST_DTYPES`);
* :func:`meta_optimizer`: AdamW as the run configures it, :class:`FusedAdamWOnMeta` for the fused one (which torch
  refuses on meta);
* :func:`meta_step`: the :class:`~voxdiff.step.TrainStep` of a model on meta, with both of the above, decided for
  ``cuda`` (meta stands for a GPU);
* :func:`tracker_for`, :class:`PhaseRecorder`, :class:`PhaseTrace`: the storage tracker as the traces make it, and
  the peaks of named phases.

Nothing here reads a config or a run spec: the predictions hand their parts in.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from voxdiff.diffusion import Process
from voxdiff.encodings.base import Encoding
from voxdiff.preflight.autocast import CudaAutocastEmulator
from voxdiff.preflight.tracker import StorageTracker
from voxdiff.step import OptimSettings, Recipe, TrainStep
from voxdiff.step.optim import build_optimizer
from voxdiff.step.precision import AUTOCAST_DTYPES

__all__ = ["EmulatedPrecision", "FusedAdamWOnMeta", "PhaseRecorder", "PhaseTrace", "emulated_precision", "meta_optimizer",
           "meta_step", "tracker_for"]


class EmulatedPrecision:
    """The precision context of a traced :class:`~voxdiff.step.TrainStep`: CUDA autocast emulated on meta tensors.

    The forward runs in an emulated autocast region; the backward keeps the emulation active for the whole
    backward pass (``torch.utils.checkpoint`` recomputation re-enters autocast, as on the GPU); there is no loss
    scaler (fp16 AMP's ``GradScaler`` holds a few scalars and unscales in place).
    """

    scales_loss = False

    def __init__(self, autocast: CudaAutocastEmulator) -> None:
        self.autocast = autocast

    def forward(self) -> Any:
        return self.autocast.region()

    def backward(self, loss: Tensor) -> None:
        with self.autocast.backward_region():
            _run_backward(loss)

    def unscale(self, optimizer: Any) -> None:
        pass

    def step(self, optimizer: Any) -> None:
        optimizer.step()


class FusedAdamWOnMeta:
    """Stand-in for ``torch.optim.AdamW(fused=True)``, which refuses meta tensors.

    It allocates what the fused optimizer allocates (``exp_avg`` and ``exp_avg_sq`` like the parameter, and a
    0-dim fp32 ``step`` per parameter on the device on the first step) and updates with the real
    ``torch._fused_adamw_`` kernel, which works in place (no temporaries).
    """

    def __init__(self, params: Iterable[nn.Parameter], settings: OptimSettings) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.param_groups = [{"params": self.params}]
        self.settings = settings
        self.state: dict[nn.Parameter, dict[str, Tensor]] = {}

    @torch.no_grad()
    def step(self) -> None:
        ps = [p for p in self.params if p.grad is not None]
        for p in ps:
            if p not in self.state:
                self.state[p] = {
                    "step": torch.zeros((), dtype=torch.float32, device=p.device),
                    "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
                }
        if not ps:
            return
        st = [self.state[p] for p in ps]
        s = self.settings
        torch._foreach_add_([x["step"] for x in st], 1)
        torch._fused_adamw_(
            ps, [p.grad for p in ps], [x["exp_avg"] for x in st], [x["exp_avg_sq"] for x in st], [],
            [x["step"] for x in st], lr=s.lr, beta1=s.betas[0], beta2=s.betas[1], weight_decay=s.weight_decay,
            eps=s.eps, amsgrad=False, maximize=False,
        )  # fmt: skip

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None


def emulated_precision(precision: str) -> EmulatedPrecision:
    """The emulated precision context of a step traced in ``precision`` (``bf16-mixed``, ``16-mixed``, ``32-true``,
    as :func:`voxdiff.step.decide_precision` decided it): CUDA autocast to its dtype on meta, disabled for fp32."""
    dtype = AUTOCAST_DTYPES[precision]
    return EmulatedPrecision(CudaAutocastEmulator(dtype=dtype or torch.bfloat16, device_type="meta",
                                                  enabled=dtype is not None))


def meta_optimizer(params: Iterable[nn.Parameter], settings: OptimSettings, impl: str) -> Any:
    """AdamW over ``params`` as ``settings`` configure it in implementation ``impl``
    (:func:`voxdiff.step.optim.optimizer_impl`): the fused one's stand-in on meta, else torch's own."""
    params = list(params)
    return FusedAdamWOnMeta(params, settings) if impl == "fused" else build_optimizer(params, settings, impl)


def meta_step(model: nn.Module, recipe: Recipe, precision: str, *, encoding: Encoding | None = None,
              mode: str = "bravo", process: Process | None = None) -> TrainStep:
    """The training step of ``model`` (on meta) as the GPU run makes it: ``recipe``, ``precision`` emulated
    (:func:`emulated_precision`), its optimizer implementation decided for ``cuda`` (the meta tensors stand for a
    GPU) and configured (:class:`FusedAdamWOnMeta` for fused AdamW)."""
    step = TrainStep(model, recipe, encoding=encoding, mode=mode, process=process,
                     precision=emulated_precision(precision), device_type="cuda")
    trainable = [p for p in model.parameters() if p.requires_grad]
    step.configure_optimizer(optimizer=FusedAdamWOnMeta(trainable, recipe.optim)
                             if step.optimizer_impl == "fused" else None)
    return step


def tracker_for(device_type: str, granularity: int | None = None, cuda_kernels: bool | None = None) -> StorageTracker:
    """A tracker as the step's trace makes it: on ``meta`` (standing for a GPU) the CUDA allocator's 512 B rounding
    and the CUDA kernels' temporaries; elsewhere (real CPU tensors, checked against the CPU allocator) neither."""
    on_meta = device_type == "meta"
    kernels = on_meta if cuda_kernels is None else cuda_kernels
    return StorageTracker(device_type=device_type, record_events=True, granularity=granularity or (512 if on_meta else 1),
                          kernel_temporaries=None if kernels else {})


class PhaseRecorder:
    """A :class:`~voxdiff.step.PhaseProbe` that keeps the tracker's peak of every named phase, per step (a phase that
    occurs twice in a step keeps the larger peak)."""

    def __init__(self, tracker: StorageTracker) -> None:
        self.tracker = tracker
        self.current: dict[str, int] = {}
        self.steps: list[dict[str, int]] = []
        self.open: str | None = None

    def begin(self, phase: str) -> None:
        self.tracker.begin_phase(f"{phase}{len(self.steps) + 1}")
        self.open = phase

    def end(self, phase: str) -> None:
        self.current[phase] = max(self.current.get(phase, 0), self.tracker.end_phase().peak)
        self.open = None

    def switch(self, phase: str) -> None:
        """End the open phase (if any) and begin ``phase`` (e.g. from an autograd hook in the middle of backward)."""
        if self.open is not None:
            self.end(self.open)
        self.begin(phase)

    def finish_step(self) -> dict[str, int]:
        """Close the step: its phase peaks are appended to :attr:`steps` and returned."""
        self.steps.append(self.current)
        self.current = {}
        return self.steps[-1]


@dataclass
class PhaseTrace:
    """Raw result of a traced phase: peaks per named phase and the live bytes at the start (no workspaces).

    Attributes:
        peaks: phase name -> peak live bytes (``max_memory_allocated`` after a reset at the phase start).
        start_bytes: live bytes when tracing began (what was resident: weights, optimizer state, EMA, ...).
        events: the allocation/free sequence for :func:`voxdiff.preflight.tracker.simulate_reserved`.
    """

    peaks: dict[str, int]
    start_bytes: int
    events: list[tuple[int, int, int]]

    @property
    def peak(self) -> int:
        return max(self.peaks.values())


def _run_backward(loss: Tensor) -> None:
    """``loss.backward()`` that keeps the emulation modes active for the whole backward pass.

    ``Tensor.backward`` and ``torch.autograd.backward`` dispatch through ``__torch_function__``, and a
    TorchFunctionMode is popped while it handles a call: the backward (and the recomputation that
    ``torch.utils.checkpoint`` runs inside it) would then run without CUDA-autocast emulation, whereas on the
    GPU checkpoint re-enters autocast for the recomputation. Calling the autograd engine directly, as
    ``torch.autograd.backward`` does after its ``__torch_function__`` check, avoids that.
    """
    from torch.autograd.graph import _engine_run_backward

    _engine_run_backward(
        (loss,), (torch.ones_like(loss),), False, False, (), allow_unreachable=True, accumulate_grad=True
    )
