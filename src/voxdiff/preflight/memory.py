"""GPU-free prediction of the peak GPU memory of one training step.

:func:`predict_step_memory` builds the model on the ``meta`` device, makes the training step of a
:class:`~voxdiff.step.Recipe` around it — the very :class:`~voxdiff.step.TrainStep` that Lightning drives in
``train.py`` and the measure mode runs on a GPU — and runs two of its steps (:meth:`TrainStep.run`: forward,
backward, clipping and the guard, optimizer step, post-step hooks, the recipe's gradient order) under three modes:

* :class:`~voxdiff.preflight.autocast.CudaAutocastEmulator` is the step's precision context
  (:class:`EmulatedPrecision`): every op gets the dtype CUDA autocast would give it (above autograd, so the
  tensors saved for backward have their GPU dtypes);
* :class:`~voxdiff.preflight.attention.FlashAttentionEmulator` (``attention="flash"``) makes SDPA keep what
  FlashAttention-2 keeps instead of the O(N^2) math path that ``meta`` takes;
* :class:`~voxdiff.preflight.tracker.StorageTracker` counts the bytes of every live storage, rounded as the
  CUDA caching allocator rounds them, and the peak of each phase.

Step 1 has no optimizer state during forward and backward; step 2 is the steady state (the AdamW state lives
through forward and backward, and so do the previous step's gradients when the recipe frees them only before
the next backward, as Lightning's automatic optimisation does).

With ``compile=True`` the model in the step is a stand-in for ``torch.compile(model)``
(:class:`~voxdiff.preflight.compiled.CompiledModule`: the forward and backward inductor's graphs allocate), wrapped for
the rank as the model would be (DDP); an FSDP rank, and a model the compiled trace refuses, are traced eagerly (the
report's ``model_step``: ``upper bound (eager)``).

A run's step (:func:`predict_memory`) is made from its run spec alone: the UNet of the spec (with its
checkpointing policy), the recipe of ``preflight.recipe`` (:func:`traced_recipe`; ``system``: the run's own — the
configured diffusion loss, AdamW as ``system.optim`` sets it, ``trainer.gradient_clip_val`` and the non-finite
guard, the EMA, gradients freed after the optimizer step; ``seed``: the reference measurements' step), the batch the
data module hands over (:attr:`~voxdiff.run.spec.RunSpec.batch`: ``data.batch_size`` volumes, or latents for a
learned encoding), and the precision
:func:`voxdiff.step.decide_precision` picks for the GPU (:data:`PREDICTED_DEVICE`). The measure mode
(:mod:`voxdiff.benchmarks.measure`) runs the same step on a GPU.

Units: every ``*_bytes`` value is in bytes; the ``*_gib`` properties divide by 2**30.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

import torch
from omegaconf import DictConfig
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from voxdiff.diffusion import Process
from voxdiff.encodings.base import Encoding
from voxdiff.models.unet import UNetSpec, build_unet_from_spec
from voxdiff.preflight.attention import FlashAttentionEmulator
from voxdiff.preflight.autocast import CudaAutocastEmulator
from voxdiff.preflight.compiled import CompiledModule, CompiledTraceError, compiled_profile
from voxdiff.preflight.distributed import fake_world, wrap_for_rank
from voxdiff.preflight.tracker import CUDA_CONTEXT_BYTES, StorageTracker, round_block, simulate_reserved
from voxdiff.preflight.world import EmulatedPrecision, meta_step, tracker_for
from voxdiff.run.gpus import DEFAULT_GPU, GpuSpec, gpu_type
from voxdiff.run.spec import Parallel, RunSpec, run_spec
from voxdiff.step import SEED, Recipe, TrainStep
from voxdiff.step.precision import AUTOCAST_DTYPES
from voxdiff.units import GiB

__all__ = [
    "DEFAULT_SAFETY_MARGIN",
    "PREDICTED_DEVICE",
    "MemoryReport",
    "StepPeaks",
    "TraceResult",
    "predict_memory",
    "predict_step_memory",
    "diffusion_run",
    "traced_recipe",
    "traced_unet",
    "trace_training_step",
    "unet_batch",
]

AttentionMode = Literal["materialised", "flash"]

DEFAULT_SAFETY_MARGIN = 0.10
"""Head-room asked on top of the predicted peak before a configuration is said to fit. PyTorch's own
``MemTracker`` tests accept +-10 % of ``max_memory_allocated``, and the reference measurements of one
configuration vary by up to 15 % between runs; 10 % covers the former and most of the latter."""

_COMPILE_MODES_MODELLED = (None, "default", "max-autotune-no-cudagraphs")
_ATTENTION = ("materialised", "flash")


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
        ema_bytes: bytes of the EMA copy of the weights (0 without an EMA).
        input_shape: shape of the model input ``(B, C_in, *spatial)``.
        precision: ``"bf16-mixed"``, ``"16-mixed"`` or ``"32-true"``.
        optimizer: description of the optimizer traced (e.g. ``"AdamW(foreach)"``).
        recipe: the name of the training-step recipe traced (``system`` or ``seed``).
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
        model_step: how the model runs in the predicted step: ``eager``, ``compiled`` (``torch.compile``,
            inductor) or ``upper bound (eager)`` (compiled was asked, its prediction failed: see ``notes``).
        parallel: what the trace is of: ``one GPU``, or one rank of ``ddp×N`` / ``fsdp×N``
            (:meth:`voxdiff.run.spec.Parallel.describe`); ``param_bytes`` and ``ema_bytes`` are then
            this rank's (shards under FSDP).
    """

    params: int
    trainable_params: int
    param_bytes: int
    ema_bytes: int
    input_shape: tuple[int, ...]
    precision: str
    optimizer: str
    recipe: str
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
    model_step: str = "eager"
    parallel: str = "one GPU"

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
            f"params {self.params / 1e6:.1f} M ({_gib(self.param_bytes):.2f} GiB"
            + (f", EMA {_gib(self.ema_bytes):.2f} GiB" if self.ema_bytes else "")
            + f"), input {self.input_shape}, {self.precision}, {self.optimizer}, step {self.recipe} "
            f"({self.model_step}), attention {self.attention_path}"
            + ("" if self.parallel == "one GPU" else f"; per rank of {self.parallel}"),
            "step 1   : fwd {forward:.2f}  bwd {backward:.2f}  opt {optimizer:.2f} GiB".format(**s1),
            "steady   : fwd {forward:.2f}  bwd {backward:.2f}  opt {optimizer:.2f} GiB".format(**s2),
            f"peak allocated {self.peak_allocated_gib:.2f} GiB, reserved ~{_gib(self.estimated_reserved):.2f} GiB, "
            f"total GPU ~{self.estimated_total_gpu_gib:.2f} GiB (incl. {_gib(self.cuda_context_bytes):.2f} GiB "
            f"CUDA context) on {self.gpu}",
        ]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def unet_batch(input_shape: Sequence[int], out_channels: int) -> tuple[dict[str, tuple[int, ...]], str]:
    """A batch of encodings for a bare UNet of input ``(B, C_in, *spatial)``: ``image_z`` (the ``out_channels``
    the UNet denoises) and ``mask_z`` (the other ``C_in - C_out`` channels, the condition) in bravo mode; ``mask_z``
    alone in seg mode (``C_in == C_out``). Returns the shapes and the mode."""
    b, c_in, *spatial = (int(s) for s in input_shape)
    if c_in == out_channels:
        return {"mask_z": (b, c_in, *spatial)}, "seg"
    if c_in < out_channels:
        raise ValueError(f"input_shape has {c_in} channels, fewer than the model's out_channels={out_channels}")
    return {"image_z": (b, out_channels, *spatial), "mask_z": (b, c_in - out_channels, *spatial)}, "bravo"


def _check_choice(name: str, value: str, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not supported; choose one of {', '.join(map(repr, choices))}")


def predict_step_memory(
    build_model: Callable[[], nn.Module],
    input_shape: Sequence[int],
    recipe: Recipe,
    *,
    batch: Mapping[str, Sequence[int]] | None = None,
    encoding: Encoding | None = None,
    mode: str | None = None,
    process: Process | None = None,
    precision: str = "bf16-mixed",
    attention: AttentionMode = "materialised",
    gpu: str | GpuSpec = DEFAULT_GPU,
    compile: bool = False,
    compile_mode: str | None = None,
    parallel: Parallel | None = None,
) -> MemoryReport:
    """Predict ``torch.cuda.max_memory_allocated()`` of a training step without a GPU (on one rank of a DDP or
    FSDP run, given ``parallel``).

    Args:
        build_model: builds the model; it is called under ``torch.device("meta")``, so it must create its
            tensors on the default device (no explicit ``device=``). Gradient checkpointing applied inside it
            (``torch.utils.checkpoint``, ``use_reentrant=False``) is traced with its real effect.
        input_shape: ``(B, C_in, *spatial)`` of the UNet input (reported; the batch by default).
        recipe: the training step traced (:data:`voxdiff.step.SEED`, or :func:`voxdiff.step.recipe_from_config`).
        batch: shapes of the data batch the step receives (``image``/``mask`` volumes, or ``image_z``/``mask_z``
            encodings); default :func:`unet_batch` of ``input_shape`` and the model's ``out_channels``.
        encoding: the encoding that turns volumes into the UNet's input (default identity).
        mode: ``bravo`` or ``seg``; default: that of :func:`unet_batch`.
        process: the diffusion process of the loss (default: from ``recipe.diffusion``).
        precision: ``"bf16-mixed"`` (CUDA autocast to bf16, fp32 weights), ``"16-mixed"`` (to fp16; the same
            bytes) or ``"32-true"``, as :func:`voxdiff.step.decide_precision` decided it.
        attention: how ``F.scaled_dot_product_attention`` behaves on the GPU: ``"flash"`` (FlashAttention-2
            where it applies) or ``"materialised"`` (the math path). A model that computes attention itself
            (MONAI with ``use_flash_attention=False``) materialises the scores either way.
        gpu: a :class:`~voxdiff.run.gpus.GpuSpec` or the name of one (:func:`~voxdiff.run.gpus.gpu_type`):
            its cuBLAS workspaces, and whether SDPA may take FlashAttention-2 there (sm80+).
        compile: predict the step with ``torch.compile(model)`` (inductor): the model's forward and backward as
            :mod:`voxdiff.preflight.compiled` plans them, the rest of the step traced as it runs. Where the
            compiled model cannot be traced, the eager step is predicted instead, an upper bound, and the report
            says so (``model_step``); so is FSDP's compiled step (its
            per-unit graphs between FSDP's hooks are not traced).
        compile_mode: ``torch.compile``'s ``mode`` (None: the default); modes with CUDA graphs are predicted as
            the default mode, with a note.
        parallel: the strategy and world size (:mod:`voxdiff.preflight.distributed`): the step is traced as rank 0
            of a DDP or FSDP run holds it; default one GPU.

    Returns:
        A :class:`MemoryReport`.

    Raises:
        ValueError: on an unknown precision or attention mode, or a malformed ``input_shape``.
    """
    _check_choice("precision", precision, tuple(AUTOCAST_DTYPES))
    _check_choice("attention", attention, _ATTENTION)
    shape = tuple(int(s) for s in input_shape)
    if len(shape) < 3 or any(s <= 0 for s in shape):
        raise ValueError(f"input_shape={tuple(input_shape)} must be (B, C_in, *spatial) with positive sizes")
    gpu_spec = gpu_type(gpu) if isinstance(gpu, str) else gpu
    t0 = time.perf_counter()
    notes: list[str] = []

    parallel = parallel or Parallel()
    dtype = AUTOCAST_DTYPES[precision]

    def built() -> nn.Module:
        with torch.device("meta"):
            model = build_model()
        if any(t.device.type != "meta" for t in [*model.parameters(), *model.buffers()]):
            note = "build_model created tensors off the meta device; they were moved to meta"
            notes.extend([] if note in notes else [note])
            model = model.to("meta")
        return model.train()

    def traced(stepped: nn.Module) -> tuple[nn.Module, TrainStep, TraceResult]:
        stepped = wrap_for_rank(stepped, parallel, mesh)  # DDP's buckets, FSDP's shards: what this rank holds
        step = meta_step(stepped, recipe, precision, encoding=encoding, mode=mode or "bravo", process=process)
        return stepped, step, trace_training_step(step, batch, attention=attention, device_type="meta", steps=2,
                                                  capability=gpu_spec.capability)

    with fake_world(parallel.world_size) if parallel.distributed else contextlib.nullcontext() as mesh:
        model = built()
        if batch is None:
            batch, default_mode = unet_batch(shape, int(getattr(model, "out_channels", shape[1])))
            mode = mode or default_mode
        model_step, attention_path, traced_step = "eager", "", None
        if compile:
            try:
                if parallel.strategy == "fsdp":
                    raise CompiledTraceError("a compiled FSDP step is not traced: torch.compile runs the units "
                                             "between FSDP's hooks, graphs the preflight does not plan")
                if attention == "flash" and not gpu_spec.flash_attention:
                    raise CompiledTraceError(f"the compiled plan assumes FlashAttention-2, which {gpu_spec.name} "
                                             f"(sm{gpu_spec.capability[0]}{gpu_spec.capability[1]}) does not run")
                inputs = [(shape, torch.float32), ((shape[0],), torch.int64)]  # x (B, C_in, *spatial), t (B,)
                profile = compiled_profile(model, inputs, dtype)
                traced_step = traced(CompiledModule(model, profile))  # DDP wraps the stand-in as it would the model
                model_step, attention_path = "compiled", profile.attention_path(attention)
            except CompiledTraceError as err:
                model_step = "upper bound (eager)"
                notes.append(f"the compiled step could not be predicted ({err}); this is the eager step's "
                             "prediction, an upper bound of the compiled one")
                model = built()  # a fresh model: the failed trace may have wrapped or stepped this one
            if compile_mode not in _COMPILE_MODES_MODELLED:
                notes.append(f"compile mode {compile_mode!r} is predicted as the default mode (its CUDA graphs' "
                             "private memory pool is not modelled and not yet measured: max_memory_allocated does "
                             "not see a replay's use of it; keep a margin)")
        if traced_step is None:
            traced_step = traced(model)
        stepped, step, trace = traced_step
        if model_step != "compiled":
            attention_path = _describe_attention(attention, trace.flash, trace.autocast, notes)
        params = list(stepped.parameters())
        trainable = [p for p in params if p.requires_grad]
        n_params = sum(p.numel() for p in params)
        param_bytes = sum(_rank_bytes(t) for t in [*params, *stepped.buffers()])
        ema_bytes = sum(_rank_bytes(t) for t in (step.ema.shadow if step.ema else []))
        impl = step.optimizer_impl
    peaks = trace.steps

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
        ema_bytes=ema_bytes,
        input_shape=shape,
        precision=precision,
        optimizer=f"AdamW({impl})",
        recipe=recipe.name,
        attention=attention,
        attention_path=attention_path,
        first_step=first,
        steady_step=steady,
        peak_allocated=peak_allocated,
        workspace_bytes=2 * ws,
        estimated_reserved=reserved,
        cuda_context_bytes=CUDA_CONTEXT_BYTES,
        estimated_total_gpu=reserved + CUDA_CONTEXT_BYTES,
        gpu=gpu_spec.describe(),
        trace_seconds=time.perf_counter() - t0,
        notes=tuple(notes),
        model_step=model_step,
        parallel=parallel.describe(),
    )


# ------------------------------------------------------------------------------------------- the step of a run
PREDICTED_DEVICE = "cuda"
"""The device the preflight predicts a run on: a GPU. It resolves the model's ``auto`` switches for it (SDPA
attention on: :meth:`voxdiff.models.UNetSpec.for_device`) and picks the optimizer torch runs there (fused AdamW)."""


def traced_recipe(run: RunSpec) -> Recipe:
    """The step the preflight traces for ``run``: the named recipe ``preflight.recipe=seed``
    (:data:`voxdiff.step.SEED`, the reference's step), else the run's own (``system``)."""
    return SEED if run.preflight.recipe == "seed" else run.recipe


def traced_unet(run: RunSpec) -> nn.Module:
    """The run's UNet as the preflight builds it (call under ``torch.device("meta")`` to build it at no cost)."""
    return build_unet_from_spec(run.unet, preserve_rng_state=False)


def diffusion_run(run: RunSpec | DictConfig) -> RunSpec:
    """``run``, or the run spec of a config resolved for :data:`PREDICTED_DEVICE`.

    Raises:
        ConfigError: every problem of the run spec (:func:`voxdiff.run.spec.run_spec`).
    """
    return run if isinstance(run, RunSpec) else run_spec(run, PREDICTED_DEVICE)


def predict_memory(run: RunSpec | DictConfig, compile: bool | None = None) -> MemoryReport:
    """Trace two training steps of ``cfg`` on the meta device, as one GPU of its strategy runs them (one rank of a
    DDP or FSDP run: :mod:`voxdiff.preflight.distributed`), for the GPU type of its run spec
    (:func:`~voxdiff.run.gpus.resolve_gpu`); see the module docstring for what is traced.

    Args:
        run: the run spec, or the run config (resolved for :data:`PREDICTED_DEVICE`). The step traced is
            :func:`traced_recipe`'s, on a batch of :attr:`~voxdiff.run.spec.RunSpec.batch`.
        compile: whether to trace a compiled run's step compiled (default) or eagerly (False: seconds instead of
            a compiled trace; the report's ``model_step`` is then ``upper bound (eager)``). Whether the run compiles
            is ``model.compile`` as a GPU run resolves it (``auto`` and ``true`` compile:
            :meth:`voxdiff.models.UNetSpec.for_device`), in ``model.compile_mode``; a backend other than inductor
            (``aot_eager``) is predicted as the eager step.

    Raises:
        ConfigError: every problem of the run spec (:func:`diffusion_run`).
    """
    run = diffusion_run(run)
    spec = run.unet
    batch = run.batch
    compiles = spec.compile and spec.compile_backend == "inductor"
    report = predict_step_memory(
        lambda: traced_unet(run), (run.batch_size, *run.shapes.unet_input),
        traced_recipe(run), batch=batch, encoding=run.encoding, mode=run.mode, precision=run.precision.name,
        attention="flash" if spec.use_flash_attention else "materialised", gpu=run.gpu,
        parallel=run.parallel, compile=compiles and compile is not False, compile_mode=spec.compile_mode,
    )
    if compiles and compile is False:
        return replace(report, model_step="upper bound (eager)", notes=(*report.notes, (
            "the run compiles its model (model.compile); its step was traced eagerly here, an upper bound")))
    return report


def _rank_bytes(tensor: Tensor) -> int:
    """Bytes of ``tensor`` on this rank, as the caching allocator counts them (a DTensor: its local shard)."""
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return round_block(local.untyped_storage().nbytes())


@dataclass
class TraceResult:
    """Raw result of :func:`trace_training_step`; bytes, no workspaces or context added.

    Attributes:
        steps: per-phase peaks of each traced step.
        start_bytes: live bytes when tracing began (the step's tensors: weights, buffers, gradients, optimizer
            state, EMA).
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
    step: TrainStep,
    batch: Mapping[str, Sequence[int]],
    *,
    attention: AttentionMode = "materialised",
    device_type: str = "meta",
    granularity: int | None = None,
    steps: int = 2,
    cuda_kernels: bool | None = None,
    capability: tuple[int, int] = (9, 0),
) -> TraceResult:
    """Run ``steps`` calls of :meth:`TrainStep.run` and record live bytes on ``device_type``, per phase.

    This is the measuring core of :func:`predict_step_memory`; it also runs on real tensors (e.g. on the CPU,
    to check the tracker against the allocator, or the trace against the step itself).

    Args:
        step: the training step, its model on ``device_type``, its optimizer configured, and an
            :class:`EmulatedPrecision` as its precision context.
        batch: the shapes of the batch tensors (drawn with ``torch.randn`` on ``device_type``, inside the trace).
        attention: ``"flash"`` to emulate FlashAttention-2 for SDPA calls, else ``"materialised"``.
        device_type: the device whose storages are counted.
        granularity: allocation rounding (default: the CUDA allocator's 512 B on meta, 1 B elsewhere).
            The CUDA kernel temporaries of :data:`~voxdiff.preflight.tracker.KERNEL_TEMPORARIES` are added on
            meta only.
        steps: how many steps to trace.
        cuda_kernels: add the CUDA kernel temporaries (default: on meta only; False traces meta tensors as the
            CPU allocates, to compare with a CPU run).
        capability: the compute capability of the GPU traced for (FlashAttention-2 needs sm80+).

    Returns:
        A :class:`TraceResult`.
    """
    if not isinstance(step.precision, EmulatedPrecision):
        raise TypeError("trace_training_step needs a TrainStep whose precision context is an EmulatedPrecision")
    tracker = tracker_for(device_type, granularity, cuda_kernels)  # meta stands for CUDA: its rounding, its kernels
    autocast = step.precision.autocast
    flash = FlashAttentionEmulator(capability) if attention == "flash" else None
    probe = _PhasePeaks(tracker)
    with tracker:
        tracker.track_all(step.tensors())
        start = tracker.live
        data = {k: torch.randn(tuple(shape), device=device_type) for k, shape in batch.items()}
        with flash if flash is not None else contextlib.nullcontext(), autocast:
            for _ in range(steps):
                step.run(data, probe)
                probe.finish_step()
        del data
    return TraceResult(steps=probe.steps, start_bytes=start, events=tracker.events, autocast=autocast, flash=flash)


class _PhasePeaks:
    """The :class:`~voxdiff.step.PhaseProbe` of a trace: the tracker's peak of each phase of each step."""

    def __init__(self, tracker: StorageTracker) -> None:
        self.tracker = tracker
        self.current: dict[str, int] = {}
        self.steps: list[StepPeaks] = []

    def begin(self, phase: str) -> None:
        self.tracker.begin_phase(f"{phase}{len(self.steps) + 1}")

    def end(self, phase: str) -> None:
        self.current[phase] = self.tracker.end_phase().peak

    def finish_step(self) -> None:
        self.steps.append(StepPeaks(self.current["forward"], self.current["backward"], self.current["optimizer"]))
        self.current = {}


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
                "some SDPA calls are outside FlashAttention-2's conditions (an sm80+ GPU, fp16/bf16, head_dim <= 256, no "
                "mask) and "
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
