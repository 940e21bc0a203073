"""GPU-free prediction of the peak GPU memory of one training step.

:func:`predict_step_memory` builds the model on the ``meta`` device and runs two real training steps on it
(forward, backward, optimizer step, ``zero_grad(set_to_none=True)``) under three modes:

* :class:`~voxdiff.preflight.autocast.CudaAutocastEmulator` gives every op the dtype CUDA autocast would give
  it (above autograd, so the tensors saved for backward have their GPU dtypes);
* :class:`~voxdiff.preflight.attention.FlashAttentionEmulator` (``attention="flash"``) makes SDPA keep what
  FlashAttention-2 keeps instead of the O(N^2) math path that ``meta`` takes;
* :class:`~voxdiff.preflight.tracker.StorageTracker` counts the bytes of every live storage, rounded as the
  CUDA caching allocator rounds them, and the peak of each phase.

Step 1 has no optimizer state during forward and backward; step 2 is the steady state (the AdamW state lives
through forward and backward). By default the gradients of the previous step are released the way Lightning's
automatic optimisation does it: ``zero_grad`` runs inside the optimizer closure *after* ``training_step`` (the
forward) and before ``backward``, so they are still alive during the steady-state forward.

Units: every ``*_bytes`` value is in bytes; the ``*_gib`` properties divide by 2**30.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from voxdiff.preflight.allocator import CUDA_CONTEXT_BYTES, GPUS, GpuSpec, simulate_reserved
from voxdiff.preflight.attention import FlashAttentionEmulator
from voxdiff.preflight.autocast import CudaAutocastEmulator
from voxdiff.preflight.tracker import StorageTracker, round_block

__all__ = [
    "DEFAULT_SAFETY_MARGIN",
    "GiB",
    "LossFn",
    "MemoryReport",
    "StepPeaks",
    "TraceResult",
    "diffusion_loss",
    "predict_step_memory",
    "trace_training_step",
]

GiB = 2**30

LossFn = Callable[[nn.Module, Tensor], Tensor]
"""``loss_fn(model, batch) -> scalar loss``: the function the trainer runs in its training step."""

Precision = Literal["bf16-mixed", "32-true"]
AttentionMode = Literal["materialised", "flash"]
OptimizerImpl = Literal["foreach", "fused", "single"]
ZeroGradAt = Literal["before_backward", "after_step"]

DEFAULT_SAFETY_MARGIN = 0.10
"""Head-room asked on top of the predicted peak before a configuration is said to fit. PyTorch's own
``MemTracker`` tests accept +-10 % of ``max_memory_allocated``, and the reference measurements of one
configuration vary by up to 15 % between runs; 10 % covers the former and most of the latter."""

_PRECISIONS = ("bf16-mixed", "32-true")
_ATTENTION = ("materialised", "flash")
_OPTIMIZER_IMPLS = ("foreach", "fused", "single")
_ZERO_GRAD_AT = ("before_backward", "after_step")


def _gib(nbytes: int | float) -> float:
    return nbytes / GiB


@dataclass(frozen=True)
class StepPeaks:
    """Peak allocated bytes of each phase of one training step (``max_memory_allocated`` after a reset at the
    start of the phase).

    Attributes:
        forward: peak during the loss function (forward pass and loss).
        backward: peak during ``loss.backward()``.
        optimizer: peak during ``optimizer.step()``.
    """

    forward: int
    backward: int
    optimizer: int

    @property
    def peak(self) -> int:
        """Peak over the whole step, in bytes."""
        return max(self.forward, self.backward, self.optimizer)

    def gib(self) -> dict[str, float]:
        """The peaks in GiB (2**30 bytes)."""
        return {"forward": _gib(self.forward), "backward": _gib(self.backward), "optimizer": _gib(self.optimizer)}


@dataclass(frozen=True)
class MemoryReport:
    """Predicted GPU memory of one training step. Byte counts are bytes; ``*_gib`` are GiB (2**30 bytes).

    Attributes:
        params: number of parameters (trainable or not).
        trainable_params: number of parameters with ``requires_grad``.
        param_bytes: bytes of parameters and buffers (fp32 master weights), as allocated on the GPU.
        input_shape: shape of the model input ``(B, C_in, *spatial)``.
        precision: ``"bf16-mixed"`` or ``"32-true"``.
        optimizer: description of the optimizer traced (e.g. ``"AdamW(foreach)"``).
        attention: the requested SDPA behaviour (``"materialised"`` or ``"flash"``).
        attention_path: what the trace actually did with attention (SDPA calls as flash or math, or softmax
            over materialised scores computed by the model itself).
        first_step: per-phase peaks of step 1 (no optimizer state before ``step()``).
        steady_step: per-phase peaks of a later step (optimizer state alive throughout).
        peak_allocated: predicted ``torch.cuda.max_memory_allocated()`` over training (max of both steps), including
            the cuBLAS workspaces.
        workspace_bytes: cuBLAS workspaces added to the traced peaks (allocated through the caching allocator).
        estimated_reserved: predicted ``torch.cuda.max_memory_reserved()`` (segments of the caching allocator,
            replayed from the trace, plus the workspaces).
        cuda_context_bytes: CUDA context, outside the caching allocator.
        estimated_total_gpu: ``estimated_reserved + cuda_context_bytes``: what ``nvidia-smi`` would show.
        gpu: the GPU model assumed for workspaces and capacity.
        trace_seconds: wall time of the prediction.
        notes: caveats found while tracing.
    """

    params: int
    trainable_params: int
    param_bytes: int
    input_shape: tuple[int, ...]
    precision: str
    optimizer: str
    attention: str
    attention_path: str
    first_step: StepPeaks
    steady_step: StepPeaks
    peak_allocated: int
    workspace_bytes: int
    estimated_reserved: int
    cuda_context_bytes: int
    estimated_total_gpu: int
    gpu: str
    trace_seconds: float
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def peak_allocated_gib(self) -> float:
        """``peak_allocated`` in GiB."""
        return _gib(self.peak_allocated)

    @property
    def estimated_total_gpu_gib(self) -> float:
        """``estimated_total_gpu`` in GiB."""
        return _gib(self.estimated_total_gpu)

    def required_bytes(self, safety_margin: float = DEFAULT_SAFETY_MARGIN) -> int:
        """Device memory a run needs: ``peak_allocated * (1 + safety_margin) + cuda_context_bytes``.

        The verdict uses allocated rather than reserved memory: when ``cudaMalloc`` fails, the caching
        allocator frees its unused cached segments and retries before raising out-of-memory.
        """
        return math.ceil(self.peak_allocated * (1.0 + safety_margin)) + self.cuda_context_bytes

    def fits(self, budget_bytes: int, safety_margin: float = DEFAULT_SAFETY_MARGIN) -> bool:
        """Whether :meth:`required_bytes` stays within ``budget_bytes``."""
        return self.required_bytes(safety_margin) <= budget_bytes

    def summary(self) -> str:
        """A few human-readable lines."""
        s1, s2 = self.first_step.gib(), self.steady_step.gib()
        lines = [
            f"params {self.params / 1e6:.1f} M ({_gib(self.param_bytes):.2f} GiB), input {self.input_shape}, "
            f"{self.precision}, {self.optimizer}, attention {self.attention_path}",
            "step 1   : fwd {forward:.2f}  bwd {backward:.2f}  opt {optimizer:.2f} GiB".format(**s1),
            "steady   : fwd {forward:.2f}  bwd {backward:.2f}  opt {optimizer:.2f} GiB".format(**s2),
            f"peak allocated {self.peak_allocated_gib:.2f} GiB, reserved ~{_gib(self.estimated_reserved):.2f} GiB, "
            f"total GPU ~{self.estimated_total_gpu_gib:.2f} GiB (incl. {_gib(self.cuda_context_bytes):.2f} GiB "
            f"CUDA context) on {self.gpu}",
        ]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def diffusion_loss(model: nn.Module, x: Tensor, num_train_timesteps: int = 1000) -> Tensor:
    """The default loss of one diffusion training step (epsilon prediction, fp32 MSE).

    The first ``model.out_channels`` channels of ``x`` are the image (the noising target), the rest is the
    conditioning that is concatenated to the noisy image (bravo mode: ``C_in = 2 * out_channels``).

    Args:
        model: the denoiser, called as ``model(x_t, t)``.
        x: the clean batch ``(B, C_in, *spatial)``.
        num_train_timesteps: number of diffusion steps to draw ``t`` from.

    Returns:
        The scalar loss ``mse(pred.float(), noise.float())``.
    """
    b = x.shape[0]
    c_out = int(getattr(model, "out_channels", x.shape[1]))
    x_img, cond = x[:, :c_out], x[:, c_out:]
    t = torch.randint(0, num_train_timesteps, (b,), device=x.device)
    noise = torch.randn_like(x_img)
    alphas_cumprod = torch.linspace(0.9999, 1e-4, num_train_timesteps, device=x.device)
    a = alphas_cumprod[t].view(b, *([1] * (x.dim() - 1)))
    x_t = a.sqrt() * x_img + (1.0 - a).sqrt() * noise
    model_in = torch.cat([x_t, cond], dim=1) if cond.shape[1] else x_t
    pred = model(model_in, t)
    return F.mse_loss(pred.float(), noise.float())


class _FusedAdamWOnMeta:
    """Stand-in for ``torch.optim.AdamW(fused=True)``, which refuses meta tensors.

    It allocates what the fused optimizer allocates (``exp_avg`` and ``exp_avg_sq`` like the parameter, and a
    0-dim fp32 ``step`` per parameter on the device on the first step) and updates with the real
    ``torch._fused_adamw_`` kernel, which works in place (no temporaries).
    """

    def __init__(self, params: Iterable[nn.Parameter], lr: float, weight_decay: float) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.lr, self.weight_decay = lr, weight_decay
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
        torch._foreach_add_([s["step"] for s in st], 1)
        torch._fused_adamw_(
            ps, [p.grad for p in ps], [s["exp_avg"] for s in st], [s["exp_avg_sq"] for s in st], [],
            [s["step"] for s in st], lr=self.lr, beta1=0.9, beta2=0.999, weight_decay=self.weight_decay,
            eps=1e-8, amsgrad=False, maximize=False,
        )  # fmt: skip

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None


def _make_optimizer(
    optimizer: str | Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    impl: str,
    params: list[nn.Parameter],
    lr: float,
    weight_decay: float,
) -> tuple[object, str]:
    if callable(optimizer):
        opt = optimizer(params)
        return opt, type(opt).__name__
    if optimizer.lower() != "adamw":
        raise ValueError(
            f"optimizer={optimizer!r} is not known; pass 'adamw' or a callable params -> torch.optim.Optimizer"
        )
    if impl == "fused":
        return _FusedAdamWOnMeta(params, lr, weight_decay), "AdamW(fused)"
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, foreach=(impl == "foreach"))
    return opt, f"AdamW({impl})"


def _check_choice(name: str, value: str, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not supported; choose one of {', '.join(map(repr, choices))}")


def predict_step_memory(
    build_model: Callable[[], nn.Module],
    input_shape: Sequence[int],
    loss_fn: LossFn | None = None,
    *,
    precision: Precision = "bf16-mixed",
    optimizer: str | Callable[[list[nn.Parameter]], torch.optim.Optimizer] = "adamw",
    optimizer_impl: OptimizerImpl = "foreach",
    attention: AttentionMode = "materialised",
    zero_grad_at: ZeroGradAt = "before_backward",
    gpu: str | GpuSpec = "H100",
    after_step: Callable[[nn.Module], None] | None = None,
    lr: float = 1e-4,
    weight_decay: float = 1e-2,
) -> MemoryReport:
    """Predict ``torch.cuda.max_memory_allocated()`` of a training step without a GPU.

    Args:
        build_model: builds the model; it is called under ``torch.device("meta")``, so it must create its
            tensors on the default device (no explicit ``device=``). Gradient checkpointing applied inside it
            (``torch.utils.checkpoint``, ``use_reentrant=False``) is traced with its real effect.
        input_shape: ``(B, C_in, *spatial)`` of the batch handed to ``loss_fn``.
        loss_fn: ``loss_fn(model, x) -> loss``, the trainer's own training-step loss; defaults to
            :func:`diffusion_loss`. It runs inside one autocast region (as Lightning's precision plugin
            wraps ``training_step``).
        precision: ``"bf16-mixed"`` (CUDA autocast to bf16, fp32 weights) or ``"32-true"``.
        optimizer: ``"adamw"`` or a callable ``params -> torch.optim.Optimizer`` that works on meta tensors.
        optimizer_impl: AdamW implementation: ``"foreach"`` (torch default on CUDA), ``"fused"`` or
            ``"single"`` (``foreach=False``).
        attention: how ``F.scaled_dot_product_attention`` behaves on the GPU: ``"flash"`` (FlashAttention-2
            where it applies) or ``"materialised"`` (the math path). A model that computes attention itself
            (MONAI with ``use_flash_attention=False``) materialises the scores either way.
        zero_grad_at: when the previous step's gradients are freed: ``"before_backward"`` (Lightning's
            automatic optimisation: after the forward) or ``"after_step"`` (a loop calling ``zero_grad``
            right after ``step()``).
        gpu: ``"H100"``, ``"A100"`` or a :class:`~voxdiff.preflight.allocator.GpuSpec` (workspace sizes).
        after_step: called with the model right after ``optimizer.step()`` (inside the optimizer phase), for
            what the trainer does there, e.g. an EMA update; it runs on meta tensors and is traced.
        lr: learning rate handed to the optimizer (no effect on memory).
        weight_decay: AdamW weight decay (no effect on memory).

    Returns:
        A :class:`MemoryReport`.

    Raises:
        ValueError: on an unknown precision, attention mode, optimizer, or a malformed ``input_shape``.
    """
    _check_choice("precision", precision, _PRECISIONS)
    _check_choice("attention", attention, _ATTENTION)
    _check_choice("optimizer_impl", optimizer_impl, _OPTIMIZER_IMPLS)
    _check_choice("zero_grad_at", zero_grad_at, _ZERO_GRAD_AT)
    shape = tuple(int(s) for s in input_shape)
    if len(shape) < 3 or any(s <= 0 for s in shape):
        raise ValueError(f"input_shape={tuple(input_shape)} must be (B, C_in, *spatial) with positive sizes")
    gpu_spec = GPUS[gpu] if isinstance(gpu, str) else gpu
    loss_fn = loss_fn or diffusion_loss
    t0 = time.perf_counter()
    notes: list[str] = []

    with torch.device("meta"):
        model = build_model()
    if any(t.device.type != "meta" for t in [*model.parameters(), *model.buffers()]):
        notes.append("build_model created tensors off the meta device; they were moved to meta")
        model = model.to("meta")
    model.train()
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    n_params = sum(p.numel() for p in params)
    param_bytes = sum(round_block(t.untyped_storage().nbytes()) for t in [*params, *model.buffers()])

    opt, opt_name = _make_optimizer(optimizer, optimizer_impl, trainable, lr, weight_decay)
    trace = trace_training_step(
        model,
        shape,
        loss_fn,
        opt,
        precision=precision,
        attention=attention,
        zero_grad_at=zero_grad_at,
        device_type="meta",
        steps=2,
        after_step=after_step,
    )
    peaks = trace.steps
    attention_path = _describe_attention(attention, trace.flash, trace.autocast, notes)

    # cuBLAS workspaces: one for the main thread (forward, optimizer), one for the autograd device thread.
    ws = gpu_spec.cublas_workspace_bytes
    first = StepPeaks(peaks[0].forward + ws, peaks[0].backward + 2 * ws, peaks[0].optimizer + 2 * ws)
    steady = StepPeaks(peaks[1].forward + 2 * ws, peaks[1].backward + 2 * ws, peaks[1].optimizer + 2 * ws)
    peak_allocated = max(first.peak, steady.peak)
    seg_peak, _ = simulate_reserved(trace.events)
    reserved = seg_peak + 2 * ws
    notes.append("cuDNN convolution workspaces are not modelled (they depend on the algorithm cuDNN picks)")
    return MemoryReport(
        params=n_params,
        trainable_params=sum(p.numel() for p in trainable),
        param_bytes=param_bytes,
        input_shape=shape,
        precision=precision,
        optimizer=opt_name,
        attention=attention,
        attention_path=attention_path,
        first_step=first,
        steady_step=steady,
        peak_allocated=peak_allocated,
        workspace_bytes=2 * ws,
        estimated_reserved=reserved,
        cuda_context_bytes=CUDA_CONTEXT_BYTES,
        estimated_total_gpu=reserved + CUDA_CONTEXT_BYTES,
        gpu=gpu_spec.name,
        trace_seconds=time.perf_counter() - t0,
        notes=tuple(notes),
    )


@dataclass
class TraceResult:
    """Raw result of :func:`trace_training_step`; bytes, no workspaces or context added.

    Attributes:
        steps: per-phase peaks of each traced step.
        start_bytes: live bytes when tracing began (parameters, buffers, existing grads and optimizer state).
        events: the allocation/free sequence (``(+1|-1, key, bytes)``) for the allocator model.
        autocast: the autocast emulator (its ``calls`` count the ops seen in autocast regions).
        flash: the flash-attention emulator, if one was used.
    """

    steps: list[StepPeaks]
    start_bytes: int
    events: list[tuple[int, int, int]]
    autocast: CudaAutocastEmulator
    flash: FlashAttentionEmulator | None


def trace_training_step(
    model: nn.Module,
    input_shape: Sequence[int],
    loss_fn: LossFn,
    optimizer: object,
    *,
    precision: Precision = "bf16-mixed",
    attention: AttentionMode = "materialised",
    zero_grad_at: ZeroGradAt = "before_backward",
    device_type: str = "meta",
    granularity: int | None = None,
    steps: int = 2,
    after_step: Callable[[nn.Module], None] | None = None,
) -> TraceResult:
    """Run ``steps`` training steps of an existing model and record live bytes on ``device_type``.

    This is the measuring core of :func:`predict_step_memory`; it also runs on real tensors (e.g. on the CPU,
    to check the tracker against the allocator). Each step: ``loss = loss_fn(model, x)`` inside an autocast
    region (bf16-mixed), ``zero_grad`` (if ``zero_grad_at="before_backward"``), ``loss.backward()``,
    ``optimizer.step()``, ``zero_grad`` (if ``"after_step"``).

    Args:
        model: the model, its tensors on ``device_type``.
        input_shape: shape of the batch ``x`` (drawn with ``torch.randn`` on ``device_type``).
        loss_fn: ``loss_fn(model, x) -> loss``.
        optimizer: an object with ``step()`` and ``zero_grad(set_to_none=True)``.
        precision: ``"bf16-mixed"`` (CUDA autocast emulated) or ``"32-true"``.
        attention: ``"flash"`` to emulate FlashAttention-2 for SDPA calls, else ``"materialised"``.
        zero_grad_at: ``"before_backward"`` (Lightning) or ``"after_step"``.
        device_type: the device whose storages are counted.
        granularity: allocation rounding (default: the CUDA allocator's 512 B on meta, 1 B elsewhere).
            The CUDA kernel temporaries of :data:`~voxdiff.preflight.tracker.KERNEL_TEMPORARIES` are added on
            meta only.
        steps: how many steps to trace.
        after_step: called with the model after each ``optimizer.step()`` (e.g. an EMA update).

    Returns:
        A :class:`TraceResult`.
    """
    on_meta = device_type == "meta"  # meta stands for CUDA: apply the CUDA allocator's rounding and kernels
    tracker = StorageTracker(
        device_type=device_type,
        record_events=True,
        granularity=granularity or (512 if on_meta else 1),
        kernel_temporaries=None if on_meta else {},
    )
    autocast = CudaAutocastEmulator(dtype=torch.bfloat16, device_type=device_type, enabled=(precision == "bf16-mixed"))
    flash = FlashAttentionEmulator() if attention == "flash" else None
    existing = [*model.parameters(), *model.buffers()]
    existing += [p.grad for p in model.parameters() if p.grad is not None]
    state = getattr(optimizer, "state", {})
    existing += [v for st in state.values() for v in st.values() if isinstance(v, Tensor)]
    with tracker:
        tracker.track_all(existing)
        start = tracker.live
        x = torch.randn(tuple(input_shape), device=device_type)
        with flash if flash is not None else contextlib.nullcontext(), autocast:
            peaks = [
                _trace_step(model, x, loss_fn, optimizer, tracker, autocast, zero_grad_at, i, after_step)
                for i in range(1, steps + 1)
            ]
        del x
    return TraceResult(steps=peaks, start_bytes=start, events=tracker.events, autocast=autocast, flash=flash)


def _trace_step(
    model: nn.Module,
    x: Tensor,
    loss_fn: LossFn,
    opt: object,
    tracker: StorageTracker,
    autocast: CudaAutocastEmulator,
    zero_grad_at: str,
    step: int,
    after_step: Callable[[nn.Module], None] | None = None,
) -> StepPeaks:
    """Run one training step on meta tensors and return its per-phase peaks (bytes, no workspaces)."""
    tracker.begin_phase(f"forward{step}")
    with autocast.region():
        loss = loss_fn(model, x)
    fwd = tracker.end_phase().peak
    if not (isinstance(loss, Tensor) and loss.numel() == 1 and loss.requires_grad):
        raise ValueError("loss_fn must return a scalar tensor that requires grad")
    if zero_grad_at == "before_backward":
        opt.zero_grad(set_to_none=True)  # type: ignore[attr-defined]
    tracker.begin_phase(f"backward{step}")
    with autocast.backward_region():
        _run_backward(loss)
    del loss
    bwd = tracker.end_phase().peak
    tracker.begin_phase(f"optimizer{step}")
    opt.step()  # type: ignore[attr-defined]
    if after_step is not None:
        after_step(model)
    if zero_grad_at == "after_step":
        opt.zero_grad(set_to_none=True)  # type: ignore[attr-defined]
    step_peak = tracker.end_phase().peak
    return StepPeaks(fwd, bwd, step_peak)


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


def _describe_attention(
    attention: str, flash: FlashAttentionEmulator | None, autocast: CudaAutocastEmulator, notes: list[str]
) -> str:
    """Say what the trace did with attention (counts are over the two traced steps, recomputation included)."""
    sdpa = autocast.calls_of("scaled_dot_product_attention")
    softmax = autocast.calls_of("softmax")
    parts = []
    if flash is not None and flash.flash_calls:
        parts.append(f"flash ({flash.flash_calls} SDPA calls)")
    math_calls = flash.math_calls if flash is not None else sdpa
    if math_calls:
        parts.append(f"SDPA math path, O(N^2) ({math_calls} calls)")
        if flash is not None:
            notes.append(
                "some SDPA calls are outside FlashAttention-2's conditions (fp16/bf16, head_dim <= 256, no mask) and "
                "were traced on the math path; on the GPU the memory-efficient kernel may take them (an upper estimate)"
            )
    if softmax:
        parts.append(f"materialised scores ({softmax} softmax calls)")
    if attention == "flash" and not sdpa and softmax:
        notes.append(
            "attention='flash' was asked, but the model computes attention itself (softmax over materialised "
            "scores) and never calls SDPA; for MONAI build it with use_flash_attention=True"
        )
    return ", ".join(parts) if parts else "none"
