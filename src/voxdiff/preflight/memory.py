"""GPU-free prediction of a diffusion run's peak GPU memory: its training step, then its validation and sampling.

**The training step.** :func:`predict_step_memory` builds the model on the ``meta`` device, makes the training step
of a :class:`~voxdiff.step.Recipe` around it — the very :class:`~voxdiff.step.TrainStep` that Lightning drives in
``train.py`` and the measure mode runs on a GPU — and runs two of its steps (:meth:`TrainStep.run`: forward,
backward, clipping and the guard, optimizer step, post-step hooks, the recipe's gradient order) under three modes:

* :class:`~voxdiff.preflight.world.CudaAutocastEmulator` is the step's precision context
  (:class:`EmulatedPrecision`): every op gets the dtype CUDA autocast would give it (above autograd, so the
  tensors saved for backward have their GPU dtypes);
* :class:`~voxdiff.preflight.world.FlashAttentionEmulator` (``attention="flash"``) makes SDPA keep what
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

**Validation and sampling.** A run does more than its training step: every validation epoch the system swaps
the EMA weights in and computes the validation loss, and it samples from validation masks (DDIM, then decoding
through the encoding). :func:`predict_phases` traces those on the ``meta`` device with the machinery of the step's
trace — :class:`~voxdiff.preflight.tracker.StorageTracker`, the CUDA-autocast emulator, the flash-attention
emulator, the fused-AdamW stand-in — running the code the system runs:

* the config's :class:`~voxdiff.step.TrainStep` (the ``system`` recipe) runs one training step first, so that
  what lives between steps exists: weights, AdamW state, the EMA (the system frees the gradients right after the
  optimizer step, so none are resident);
* **validation**: :meth:`TrainStep.validation_loss` (what ``DiffusionSystem.validation_step`` calls) at
  ``data.batch_size`` and ``system.val_timesteps`` fixed timesteps, without gradients, in an autocast region, the
  model in eval mode, with the EMA weights swapped in — the weights and the average trade places one tensor at a
  time, so the swap holds one parameter aside, not a copy of the model;
* **sampling**: :meth:`TrainStep.generate` (what ``DiffusionSystem.generate`` calls from ``write_samples``) for
  one chunk of ``system.sampling.batch_size`` masks (every chunk holds the same): encoding the masks (``condition``),
  the sampler (DDIM, or Euler for rectified flow) with the UNet without gradients under the EMA swap, on twice the
  chunk with classifier-free guidance (``sampling``; two steps are traced: each step holds the same), and
  ``decode`` through the encoding (the S2D/Haar inverse, or the VQ-VAE decoder of a latent run, in fp32).

The run's peak is the largest of training, validation and sampling; :class:`PhasesReport` says which phase sets it.

**Sampling outside training** (``sample.py``, ``evaluate.py``): :func:`predict_sampling` traces the same
:meth:`TrainStep.generate` with what those commands hold on the device: the UNet with its EMA weights written in (no
EMA copy, no AdamW state), the guide's UNet beside it when they autoguide, a latent run's autoencoder, and the
command's own batch, guidance and window (:class:`SamplingReport`).

Units: every ``*_bytes`` value is in bytes; the ``*_gib`` properties divide by 2**30.
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch
from omegaconf import DictConfig
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from voxdiff.diffusion import Process, build_process, encoded_range
from voxdiff.diffusion.processes import timestep_dtype
from voxdiff.encodings.base import Encoding, LearnedEncoding
from voxdiff.errors import ConfigError
from voxdiff.models.unet import UNetSpec, build_unet_from_spec
from voxdiff.preflight.compiled import CompiledModule, CompiledTraceError, compiled_profile
from voxdiff.preflight.resources import validation_batch
from voxdiff.preflight.stage1 import attach_meta_autoencoder, latent_stage1_spec
from voxdiff.preflight.tracker import (
    CUDA_CONTEXT_BYTES,
    DEFAULT_SAFETY_MARGIN,
    StorageTracker,
    round_block,
    simulate_reserved,
    split_pools,
    with_margin,
)
from voxdiff.preflight.world import (
    PREDICTED_DEVICE,
    CudaAutocastEmulator,
    EmulatedPrecision,
    FlashAttentionEmulator,
    PhaseRecorder,
    PhaseTrace,
    emulated_precision,
    fake_world,
    meta_step,
    tracker_for,
    wrap_for_rank,
)
from voxdiff.run.gpus import DEFAULT_GPU, GpuSpec, gpu_type
from voxdiff.run.spec import Parallel, RunSpec, run_spec
from voxdiff.step import SEED, Recipe, TrainStep
from voxdiff.step.precision import AUTOCAST_DTYPES
from voxdiff.units import GiB

__all__ = ["DEFAULT_SAFETY_MARGIN", "MemoryReport", "PhasesReport", "SamplingReport", "StepPeaks", "TraceResult",
           "diffusion_run", "predict_memory", "predict_phases", "predict_sampling", "predict_step_memory",
           "trace_sampling", "trace_training_step", "trace_validation", "traced_recipe", "traced_unet", "unet_batch"]


AttentionMode = Literal["materialised", "flash"]


_COMPILE_MODES_MODELLED = (None, "default", "max-autotune-no-cudagraphs")
#: the phases of a training step whose allocations a CUDA-graph step makes in the graphs' private pool: the compiled
#: model's forward and backward (the forward phase's few eager tensors around the model are counted there too)
CUDA_GRAPH_PHASES = ("forward", "backward")
GRAPH_POOL_MEASURED_RATIO = 1.35
"""The CUDA graphs' private pool as measured, over its simulation (:func:`~voxdiff.preflight.tracker.split_pools`
and ``simulate_reserved`` of the traced step), at most: the verdict budgets the pool at this multiple
(:attr:`MemoryReport.graph_pool_needed`), the estimate stays the simulation's. Measured pool by pool
(``reference/h200_bench_gpu_step_v2.csv``, an H200, session 22): exp9_ldm_4x_bravo at batch 4 30.56 GiB against
22.72 simulated (1.345), exp11 at batch 32 50.33 against 41.51 (1.213), exp11 at batch 1 2.24 against 2.04 (1.100);
from the whole reserved peak less the other pool's estimate at batch 1 on an H100 (``_v4.csv``, ``_v5.csv``):
0.98-1.18. Not yet explained: the trace is of the default mode's tensors, not of inductor's buffers and cuDNN's
workspaces inside the graphs (README, "CUDA graphs")."""
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
            replayed from the trace, plus the workspaces); for a step with CUDA graphs (``cuda_graphs``) the
            segments of two pools, the graphs' private one (the forward's and the backward's allocations) and the
            rest (:func:`~voxdiff.preflight.tracker.split_pools`).
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
        cuda_graphs: whether the run replays its compiled forward and backward as CUDA graphs (a compile mode
            with them); :attr:`peak_needed` is then the reserved estimate, its graphs' pool as budgeted, where that
            is larger.
        graph_pool_bytes: the segments of the CUDA graphs' private pool (0 without them), as simulated: held
            through the validation and the sampling, which run the model eagerly, outside the pool. The verdict
            budgets :attr:`graph_pool_needed`.
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
    cuda_graphs: bool = False
    graph_pool_bytes: int = 0

    @property
    def peak_needed(self) -> int:
        """The bytes the verdict counts for the training step: the allocated peak (on an out-of-memory the caching
        allocator frees its unused cached segments and retries), or, for a step with CUDA graphs, the reserved
        estimate with the graphs' pool as budgeted (:attr:`graph_pool_needed`) where it is larger: the graphs'
        private pool keeps its segments, which nothing outside the graphs can use (README, "CUDA graphs")."""
        if not self.cuda_graphs:
            return self.peak_allocated
        return max(self.peak_allocated, self.estimated_reserved + self.graph_pool_needed - self.graph_pool_bytes)

    @property
    def graph_pool_needed(self) -> int:
        """The CUDA graphs' pool as the verdict budgets it: the simulated segments (:attr:`graph_pool_bytes`) times
        :data:`GRAPH_POOL_MEASURED_RATIO`, the most a measured pool has exceeded its simulation."""
        return math.ceil(self.graph_pool_bytes * GRAPH_POOL_MEASURED_RATIO)

    @property
    def peak_allocated_gib(self) -> float:
        """``peak_allocated`` in GiB."""
        return _gib(self.peak_allocated)

    @property
    def estimated_total_gpu_gib(self) -> float:
        """``estimated_total_gpu`` in GiB."""
        return _gib(self.estimated_total_gpu)

    def required_bytes(self, safety_margin: float = DEFAULT_SAFETY_MARGIN) -> int:
        """Device memory the training step needs: :meth:`need_bytes` of :attr:`peak_needed`.

        The verdict uses allocated rather than reserved memory (:attr:`peak_needed`): when ``cudaMalloc`` fails,
        the caching allocator frees its unused cached segments and retries before raising out-of-memory; not
        those of CUDA graphs' private pool.
        """
        return self.need_bytes(self.peak_needed, safety_margin)

    def need_bytes(self, peak: float, safety_margin: float = DEFAULT_SAFETY_MARGIN) -> int:
        """Device memory for a ``peak`` (bytes, of any phase of this run): ``peak * (1 + safety_margin) +
        cuda_context_bytes``, rounded up, but the CUDA graphs' pool the peak holds as budgeted
        (:attr:`graph_pool_needed`, already the most a measured pool exceeded its simulation) gets no margin again."""
        held = self.pool_held(peak)
        return with_margin(peak - held, safety_margin) + held + self.cuda_context_bytes

    def pool_held(self, peak: float) -> int:
        """The part of a ``peak`` that is the CUDA graphs' pool as budgeted (0 without CUDA graphs)."""
        return min(self.graph_pool_needed, int(peak)) if self.cuda_graphs else 0

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
    cuda_graphs: bool | None = None,
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
        compile_mode: ``torch.compile``'s ``mode`` (None: the default); modes with CUDA graphs are traced as the
            default mode, with a note, and their reserved memory as two allocator pools (``cuda_graphs``).
        cuda_graphs: whether the run replays CUDA graphs (None: ``compile`` in a ``compile_mode`` with them); a
            run traced eagerly (``compile=False``) that compiles with them on the GPU passes True.
        parallel: the strategy and world size (:mod:`voxdiff.preflight.world`): the step is traced as rank 0
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
                t_dtype = process.timestep_dtype if process is not None else timestep_dtype(recipe.diffusion)
                inputs = [(shape, torch.float32), ((shape[0],), t_dtype)]  # x (B, C_in, *spatial), t (B,)
                profile = compiled_profile(model, inputs, dtype)
                traced_step = traced(CompiledModule(model, profile))  # DDP wraps the stand-in as it would the model
                model_step, attention_path = "compiled", profile.attention_path(attention)
            except CompiledTraceError as err:
                model_step = "upper bound (eager)"
                notes.append(f"the compiled step could not be predicted ({err}); this is the eager step's "
                             "prediction, an upper bound of the compiled one")
                model = built()  # a fresh model: the failed trace may have wrapped or stepped this one
            if compile_mode not in _COMPILE_MODES_MODELLED:
                notes.append(f"compile mode {compile_mode!r} is traced as the default mode; its CUDA graphs' "
                             "private pool as a second allocator pool, whose reserved segments the verdict counts "
                             f"at {GRAPH_POOL_MEASURED_RATIO}x their simulation: measured pools came 0.98-1.35x "
                             "it, the larger at a large batch (exp9_ldm_4x_bravo at batch 4 on an H200, "
                             "reference/h200_bench_gpu_step_v2.csv; exp11 at batch 32: 1.21x); "
                             "max_memory_allocated does not see the pool")
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
    graphs = cuda_graphs if cuda_graphs is not None else compile and compile_mode not in _COMPILE_MODES_MODELLED
    if graphs:  # the graphs' warm-up, recording and replays allocate from their own pool (split_pools)
        pool, rest = split_pools(trace.events, trace.phase_starts, CUDA_GRAPH_PHASES)
        graph_pool = simulate_reserved(pool)[0]
        seg_peak = graph_pool + simulate_reserved(rest)[0]
    else:
        graph_pool, seg_peak = 0, simulate_reserved(trace.events)[0]
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
        cuda_graphs=bool(graphs),
        graph_pool_bytes=graph_pool,
    )


# ------------------------------------------------------------------------------------------- the step of a run
def traced_recipe(run: RunSpec) -> Recipe:
    """The step the preflight traces for ``run``: the named recipe ``preflight.recipe=seed``
    (:data:`voxdiff.step.SEED`, the reference's step), else the run's own (``system``)."""
    return SEED if run.preflight.recipe == "seed" else run.recipe


def traced_unet(run: RunSpec, ncdhw: bool = False) -> nn.Module:
    """The run's UNet as the preflight builds it (call under ``torch.device("meta")`` to build it at no cost).

    ``ncdhw``: in torch's default layout (contiguous, NCDHW) whatever ``model.channels_last`` resolves to, for the
    step of a run that compiles (its compiled plan, :func:`~voxdiff.preflight.compiled.compiled_profile`, or the eager
    trace that bounds it) and the time model. Inductor lays out a compiled graph's tensors itself, and a compiled
    channels-last step measured the memory of the NCDHW one: exp9_ldm_8x_bravo's default pool 39.744 GiB in both
    layouts, its CUDA graphs' pool 13.81 GiB channels-last against 14.20 (``reference/h200_bench_gpu_step_v3.csv``,
    ``h100_bench_gpu_step_v7.csv``). Traced channels-last, the graph holds the layout copies of the decompositions
    that inductor removes: 2.4 GiB too many for that step. The time model was fitted to NCDHW steps
    (:data:`~voxdiff.preflight.resources.CHANNELS_LAST_TIME`)."""
    spec = replace(run.unet, channels_last=False) if ncdhw else run.unet
    return build_unet_from_spec(spec, preserve_rng_state=False)


def diffusion_run(run: RunSpec | DictConfig) -> RunSpec:
    """``run``, or the run spec of a config resolved for :data:`PREDICTED_DEVICE`.

    Raises:
        ConfigError: every problem of the run spec (:func:`voxdiff.run.spec.run_spec`).
    """
    return run if isinstance(run, RunSpec) else run_spec(run, PREDICTED_DEVICE)


def predict_memory(run: RunSpec | DictConfig, compile: bool | None = None) -> MemoryReport:
    """Trace two training steps of ``cfg`` on the meta device, as one GPU of its strategy runs them (one rank of a
    DDP or FSDP run: :mod:`voxdiff.preflight.world`), for the GPU type of its run spec
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
        lambda: traced_unet(run, ncdhw=compiles), (run.batch_size, *run.shapes.unet_input),  # compiled: as NCDHW
        traced_recipe(run), batch=batch, encoding=run.encoding, mode=run.mode, precision=run.precision.name,
        attention="flash" if spec.use_flash_attention else "materialised", gpu=run.gpu,
        parallel=run.parallel, compile=compiles and compile is not False, compile_mode=spec.compile_mode,
        cuda_graphs=compiles and spec.compile_mode not in _COMPILE_MODES_MODELLED,
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
        phase_starts: ``(phase, index of its first event)`` of each step's phases (``forward1``, ``backward1``,
            ``optimizer1``, ``forward2``, ...), for :func:`~voxdiff.preflight.tracker.split_pools`.
    """

    steps: list[StepPeaks]
    start_bytes: int
    events: list[tuple[int, int, int]]
    autocast: CudaAutocastEmulator
    flash: FlashAttentionEmulator | None
    phase_starts: list[tuple[str, int]] = field(default_factory=list)


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
    return TraceResult(steps=probe.steps, start_bytes=start, events=tracker.events, autocast=autocast, flash=flash,
                       phase_starts=list(tracker.phase_starts))


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


# ---------------------------------------------------------------------------------------------- validation and sampling
#: DDIM steps traced for sampling: every step holds the same tensors, so the peak is reached by the second
MAX_TRACED_DDIM_STEPS = 2


def _flash(attention: str) -> Any:
    return FlashAttentionEmulator() if attention == "flash" else contextlib.nullcontext()


@contextlib.contextmanager
def _traced(step: TrainStep, resident: Iterable[torch.Tensor], attention: str, device_type: str,
            granularity: int | None, cuda_kernels: bool | None) -> Iterator[tuple[PhaseRecorder, PhaseTrace]]:
    """Track what runs inside (in inference mode, as Lightning's validation loop runs — the sampling at its end too:
    no gradients and no autocast weight cache; the step's autocast emulation; flash attention if asked) from the
    step's resident tensors on; the :class:`PhaseTrace` yielded is filled in when the block exits."""
    tracker = tracker_for(device_type, granularity, cuda_kernels)
    rec = PhaseRecorder(tracker)
    trace = PhaseTrace({}, 0, [])
    with tracker:
        tracker.track_all([*step.tensors(), *resident])
        trace.start_bytes = tracker.live
        with _flash(attention), step.precision.autocast, torch.inference_mode():
            yield rec, trace
    trace.peaks, trace.events = rec.finish_step(), tracker.events


def trace_validation(
    step: TrainStep,
    batch: Mapping[str, Sequence[int]],
    val_timesteps: int,
    *,
    attention: str = "materialised",
    device_type: str = "meta",
    granularity: int | None = None,
    cuda_kernels: bool | None = None,
    resident: Iterable[torch.Tensor] = (),
) -> PhaseTrace:
    """Trace one validation step: :meth:`TrainStep.validation_loss` of a batch of these shapes (drawn on
    ``device_type`` inside the trace, as Lightning moves it there), without gradients, the model in eval mode, in an
    autocast region of the step's :class:`~voxdiff.preflight.world.EmulatedPrecision`.

    Args:
        step: the training step after at least one optimizer step (its AdamW state exists).
        batch: shapes of the validation batch's tensors.
        val_timesteps: ``system.val_timesteps``.
        attention: ``"flash"`` to emulate FlashAttention-2 for SDPA calls, else ``"materialised"``.
        device_type, granularity, cuda_kernels: as :func:`~voxdiff.preflight.world.tracker_for`.
        resident: tensors on the device besides the step's own (e.g. a latent run's VQ-VAE).
    """
    was_training = step.model.training
    with _traced(step, resident, attention, device_type, granularity, cuda_kernels) as (rec, trace):
        rec.begin("validation")
        step.model.eval()
        data = {k: torch.rand(tuple(shape), device=device_type) for k, shape in batch.items()}
        with step.precision.autocast.region():
            loss, _ = step.validation_loss(data, val_timesteps)
        del data, loss
        step.model.train(was_training)
        rec.end("validation")
    return trace


def trace_sampling(
    step: TrainStep,
    mask_shape: Sequence[int],
    out_channels: int,
    num_inference_steps: int,
    *,
    attention: str = "materialised",
    device_type: str = "meta",
    granularity: int | None = None,
    cuda_kernels: bool | None = None,
    resident: Iterable[torch.Tensor] = (),
    guidance_scale: float = 1.0,
    covariate_dim: int = 0,
    guide: nn.Module | None = None,
    autoguide_scale: float = 1.0,
    unweight: bool = True,
) -> PhaseTrace:
    """Trace sampling as ``DiffusionSystem.write_samples`` runs it: ``(B, 1, D, H, W)`` masks on the device, then
    :meth:`TrainStep.generate` in an autocast region (phases ``condition``, ``sampling``, ``decode``).

    Args:
        step: the training step after at least one optimizer step.
        mask_shape: ``(B, 1, D, H, W)``: B = one chunk of masks (``system.sampling.batch_size``, at most
            ``num_masks``): every chunk holds the same.
        guidance_scale: ``system.sampling.guidance_scale`` (not 1: the UNet runs on twice the chunk).
        out_channels: the UNet's output channels.
        num_inference_steps: DDIM steps to trace.
        attention, device_type, granularity, cuda_kernels, resident: as :func:`trace_validation`.
        covariate_dim: ``K`` of a model with covariates (one ``(B, K)`` vector per mask), 0 without.
        guide, autoguide_scale: autoguidance (:meth:`TrainStep.generate`): the guide's UNet (its weights in
            ``resident`` too) runs beside the model at every step when the scale is not 1.
        unweight: a mask model trained with ``diffusion.mask_weight`` undoes it at each step (decoding and
            re-encoding each predicted x₀: :attr:`TrainStep.unweights_samples`), as it does by default.
    """
    with _traced(step, resident, attention, device_type, granularity, cuda_kernels) as (rec, trace):
        mask = torch.rand(tuple(mask_shape), device=device_type).round_()  # {0, 1}, as the cached masks
        covariates = torch.rand((mask_shape[0], covariate_dim), device=device_type) if covariate_dim else None
        with step.precision.autocast.region():
            out = step.generate(mask, out_channels, num_inference_steps, probe=rec, guidance_scale=guidance_scale,
                                covariates=covariates, guide=guide, autoguide_scale=autoguide_scale,
                                unweight=unweight)
        del mask, out
    return trace


@dataclass(frozen=True)
class PhasesReport:
    """Predicted peak GPU memory (``max_memory_allocated``, cuBLAS workspaces included) of each phase of a run.

    Attributes:
        training: the training step's peak (:class:`~voxdiff.preflight.memory.MemoryReport`'s ``peak_allocated``).
        validation: peak of a validation step under the EMA swap.
        sampling: peak of sampling: the largest of ``parts``.
        parts: ``condition`` (encoding the masks), ``sampling`` (DDIM), ``decode`` (through the encoding).
        resident: bytes alive between steps (weights, AdamW state, EMA, a latent run's VQ-VAE).
        swap_bytes: what the EMA swap holds aside while it trades weights (its largest parameter; 0 without an EMA).
        val_batch, val_timesteps: the validation loader's batch (``data.batch_size``, or the validation split's
            subjects per rank where fewer: :func:`~voxdiff.preflight.resources.validation_batch`) and
            ``system.val_timesteps``.
        sample_batch, inference_steps: the UNet's batch while sampling (a chunk of masks, twice that with guidance)
            and the sampling steps configured (two traced).
        peak_allocated: the run's peak: the largest of training, validation and sampling.
        peak_phase: the phase that sets it (``training``, ``validation`` or ``sampling``).
        training_report: the training step's full report.
        gpu: the GPU model assumed; cuda_context_bytes: CUDA context (not in the peaks).
        trace_seconds: wall time of this prediction (training's trace included); notes: caveats.
    """

    training: int
    validation: int
    sampling: int
    parts: dict[str, int]
    resident: int
    swap_bytes: int
    val_batch: int
    val_timesteps: int
    sample_batch: int
    inference_steps: int
    peak_allocated: int
    peak_phase: str
    training_report: MemoryReport
    gpu: str
    cuda_context_bytes: int = CUDA_CONTEXT_BYTES
    trace_seconds: float = 0.0
    notes: tuple[str, ...] = field(default_factory=tuple)

    def describe(self) -> str:
        """One line: every phase's peak in GiB and which one sets the run's peak."""
        p = {k: v / GiB for k, v in self.parts.items()}
        return (f"training {self.training / GiB:.2f} GiB | validation {self.validation / GiB:.2f} GiB "
                f"(B={self.val_batch}, {self.val_timesteps} timesteps, EMA swap +{self.swap_bytes / GiB:.2f}) | "
                f"sampling {self.sampling / GiB:.2f} GiB (B={self.sample_batch}, {self.inference_steps} steps: "
                f"condition {p['condition']:.2f}, sampler {p['sampling']:.2f}, decode {p['decode']:.2f}) | "
                f"peak {self.peak_allocated / GiB:.2f} GiB set by {self.peak_phase} on {self.gpu}")


def meta_guide(run: RunSpec) -> tuple[nn.Module, list[torch.Tensor]]:
    """The guide of autoguidance as the preflight traces it: the run's UNet on the meta device, frozen (as the
    commands and ``DiffusionSystem.sampling_guide`` hold it), and its tensors, resident beside the model."""
    with torch.device("meta"):
        guide = traced_unet(run).requires_grad_(False)
    return guide, [*guide.parameters(), *guide.buffers()]


def training_autoguide(run: RunSpec) -> float:
    """The autoguidance scale of the samples ``run`` draws in training (``DiffusionSystem.sampling_guide``): its
    commands' (``system.sampling.autoguide_scale``) where it takes a guide snapshot (``callbacks.guide.step``)
    before its last step (or has no step limit), else 1 (none). An FSDP run's samples are drawn without the guide
    (its UNet is sharded and the guide would not be), so 1 for it too."""
    scale, step, last = float(run.sampling.autoguide_scale), run.resources.guide_step, run.resources.max_steps
    if run.parallel.strategy == "fsdp":
        return 1.0
    return scale if scale != 1.0 and step is not None and (last < 0 or step < last) else 1.0


def predict_phases(run: RunSpec | DictConfig, training: MemoryReport | None = None) -> PhasesReport:
    """Predict the peaks of training, validation and sampling of a diffusion run on one GPU, without one.

    Args:
        run: the run spec, or a composed ``train``/``preflight`` config (resolved for the GPU predicted). It gives
            the system's recipe, the UNet, the strategy, the GPU type (cuBLAS workspaces) and the precision.
        training: the training step's report when it is already predicted (:func:`~voxdiff.preflight.memory.
            predict_memory`; the compiled one, for a compiled run); else it is predicted here.

    Raises:
        ConfigError: not a diffusion config, or a setting the step cannot work with (as the preflight's).
    """
    run = diffusion_run(run)
    if run.kind != "diffusion":
        raise ConfigError("system.kind", run.kind, "is not a diffusion run; validation and sampling are a "
                          "diffusion system's", "use voxdiff.preflight.stage1.predict_stage1 for a stage-1 config")
    t0 = time.perf_counter()
    gpu = run.gpu
    training = training or predict_memory(run)
    recipe = run.recipe  # validation and sampling are the system's, whatever preflight.recipe
    val_timesteps, num_masks = run.val_timesteps, run.sampling.num_masks
    steps = run.sampling.num_inference_steps or recipe.diffusion.num_inference_steps
    notes: list[str] = []
    strategy = run.parallel.strategy
    if strategy != "single":  # a DDP rank holds the whole model too; its buckets are not in these phases
        notes.append(f"validation and sampling traced as on one GPU (one {strategy} rank's buckets not added)")

    resident: list[torch.Tensor] = []
    if isinstance(run.encoding, LearnedEncoding):  # a latent run: its autoencoder is on the GPU once it is used
        stage1, note = latent_stage1_spec(run.encoding)
        notes.append(note)
        ae = attach_meta_autoencoder(run.encoding, stage1).autoencoder
        resident = [*ae.parameters(), *ae.buffers()]
    with torch.device("meta"):
        model = traced_unet(run)
    model.train()
    process = build_process(recipe.diffusion, clip_range=encoded_range(run.encoding))  # as the system's
    step = meta_step(model, recipe, run.precision.name, encoding=run.encoding, mode=run.mode, process=process)
    attention = "flash" if run.unet.use_flash_attention else "materialised"
    batch = run.batch
    with _flash(attention), step.precision.autocast:  # one training step: the AdamW state and the EMA exist from here on
        step.run({k: torch.randn(s, device="meta") for k, s in batch.items()})

    # the validation loader's batch: the batch size, or the validation split's subjects per rank where fewer
    val_b = validation_batch(run.resources.data or {}, next(iter(batch.values()))[0], run.parallel.world_size)
    val_batch = {k: (val_b, *s[1:]) for k, s in batch.items()}
    if "image_z" in val_batch and run.resources.masks:  # latent batches carry the full-size mask
        val_batch["mask"] = (val_b, 1, *run.shapes.volume)
    validation = trace_validation(step, val_batch, val_timesteps, attention=attention, resident=resident)
    sampling = run.sampling
    mask_shape = (max(min(num_masks, sampling.batch_size), 1), 1, *run.shapes.volume)
    autoguide = training_autoguide(run)
    guide, guide_tensors = meta_guide(run) if autoguide != 1.0 else (None, [])
    if guide is not None:  # DiffusionSystem.sampling_guide: the snapshot's UNet beside the training step's tensors
        notes.append(f"samples in training autoguided (scale {autoguide:g}) once the guide snapshot is taken "
                     f"(callbacks.guide.step={run.resources.guide_step}): its UNet traced beside the model")
    sample = trace_sampling(step, mask_shape, run.unet.out_channels, min(steps, MAX_TRACED_DDIM_STEPS),
                            attention=attention, resident=[*resident, *guide_tensors],
                            guidance_scale=float(sampling.guidance_scale), covariate_dim=run.unet.covariate_dim,
                            guide=guide, autoguide_scale=autoguide)

    ws = 2 * gpu.cublas_workspace_bytes  # both cuBLAS handles exist once training has run a backward
    parts = {k: v + ws for k, v in sample.peaks.items()}
    peaks = {"training": training.peak_allocated, "validation": validation.peak + ws, "sampling": max(parts.values())}
    phase = max(peaks, key=peaks.get)
    swap = step.ema.swap_bytes(model) if step.ema is not None else 0
    if not num_masks:
        notes.append("system.sampling.num_masks=0: no samples are drawn during training (one traced, as sample.py "
                     "n=1 draws it)")
    return PhasesReport(
        training=peaks["training"], validation=peaks["validation"], sampling=peaks["sampling"], parts=parts,
        resident=validation.start_bytes, swap_bytes=swap, val_batch=val_b,
        val_timesteps=val_timesteps, sample_batch=mask_shape[0] * (1 if float(sampling.guidance_scale) == 1.0 else 2),
        inference_steps=steps,
        peak_allocated=peaks[phase], peak_phase=phase, training_report=training, gpu=gpu.name,
        trace_seconds=time.perf_counter() - t0, notes=tuple(notes),
    )


# ------------------------------------------------------------------------------------------- standalone sampling
@dataclass(frozen=True)
class SamplingReport:
    """Predicted peak GPU memory (``max_memory_allocated``, the cuBLAS workspace included) of sampling outside
    training, as ``sample.py`` and ``evaluate.py`` hold it: the UNet with its EMA weights written in (no EMA copy, no
    AdamW state: :meth:`TrainStep.fold_ema`), the guide's UNet when autoguided, a latent run's autoencoder.

    Attributes:
        peak: the largest of ``parts``.
        parts: ``condition`` (encoding the masks), ``sampling`` (the sampler), ``decode``: each phase's peak, the
            resident weights and the workspace included.
        resident: bytes on the device before the first chunk: ``model_bytes`` + ``guide_bytes`` + the autoencoder.
        model_bytes, guide_bytes: the UNet's weights and buffers; the guide's (0 without autoguidance).
        batch: masks sampled at once (the command's ``batch_size``); unet_batch: the UNet's batch (twice that with
            classifier-free guidance); inference_steps: the sampling steps (two traced: each step holds the same).
        gpu: the GPU type predicted for (its cuBLAS workspace; none on the CPU); notes: caveats.
    """

    peak: int
    parts: dict[str, int]
    resident: int
    model_bytes: int
    guide_bytes: int
    batch: int
    unet_batch: int
    inference_steps: int
    gpu: str
    notes: tuple[str, ...] = field(default_factory=tuple)

    def required_bytes(self, safety_margin: float = DEFAULT_SAFETY_MARGIN) -> int:
        """Device memory the command's tensors need: ``peak * (1 + safety_margin)`` (the CUDA context aside)."""
        return with_margin(self.peak, safety_margin)

    def describe(self) -> str:
        """One line: the peak, the phase that sets it, and what is resident (GiB to three significant digits)."""
        phase = max(self.parts, key=self.parts.get)
        guide = f", guide {self.guide_bytes / GiB:.3g}" if self.guide_bytes else ""
        return (f"peak {self.peak / GiB:.3g} GiB in {phase} (batch {self.batch}, UNet batch {self.unet_batch}, "
                f"{self.inference_steps} steps; weights {self.resident / GiB:.3g} GiB: UNet "
                f"{self.model_bytes / GiB:.3g}{guide})")


def predict_sampling(
    run: RunSpec | DictConfig,
    batch_size: int,
    *,
    guidance_scale: float = 1.0,
    autoguide_scale: float = 1.0,
    num_inference_steps: int | None = None,
    encoding: Encoding | None = None,
    device_type: str = PREDICTED_DEVICE,
    unweight: bool = True,
) -> SamplingReport:
    """Predict the peak GPU memory of ``sample.py`` / ``evaluate.py`` sampling ``batch_size`` masks at once from a
    model of ``run``, without a GPU: :meth:`TrainStep.generate` traced on the meta device as :func:`trace_sampling`
    traces a run's own sampling, but with what the commands hold (see :class:`SamplingReport`). The commands sample
    under ``torch.no_grad()`` with frozen weights, where autocast caches no weight copies, as in the inference mode
    of the trace.

    Args:
        run: the run spec (a checkpoint's, rebuilt for the device it samples on), or a composed config.
        batch_size: masks per chunk (``batch_size``).
        guidance_scale: classifier-free guidance as the command resolved it (not 1: the UNet's batch doubles).
        autoguide_scale: autoguidance as the command resolved it (not 1: the guide's UNet is on the device too).
        num_inference_steps: as the command resolved it (None: the run's).
        encoding: the encoding the command samples with (its ``encoding.window``; a latent run's stage-1
            architecture from the weights it loaded); it is copied, never changed. None: the run's.
        device_type: where the command samples: ``cuda`` counts the cuBLAS workspace (``run.gpu``'s), ``cpu``
            none (the tensors are the same; the CPU allocator rounds nothing).
        unweight: as the command resolved it (:func:`trace_sampling`).

    Raises:
        ConfigError: not a diffusion run; a stage-1 architecture that cannot be found (:func:`latent_stage1_spec`).
    """
    run = diffusion_run(run)
    if run.kind != "diffusion":
        raise ConfigError("system.kind", run.kind, "is not a diffusion run; sampling is a diffusion system's",
                          "use voxdiff.preflight.stage1.predict_stage1 for a stage-1 config")
    gpu, notes = run.gpu, []
    encoding = copy.copy(encoding if encoding is not None else run.encoding)
    resident: list[torch.Tensor] = []
    if isinstance(encoding, LearnedEncoding):  # a latent run: its autoencoder, as the command loaded it
        stage1 = getattr(encoding, "stage1", None)
        spec, note = (stage1.spec, "stage-1 architecture of the weights loaded") if stage1 is not None else \
            latent_stage1_spec(encoding)
        notes.append(note)
        ae = attach_meta_autoencoder(encoding, spec).autoencoder
        resident = [*ae.parameters(), *ae.buffers()]
    with torch.device("meta"):
        model = traced_unet(run).requires_grad_(False)  # frozen, as TrainStep.fold_ema leaves them
    guide, guide_tensors = meta_guide(run) if float(autoguide_scale) != 1.0 else (None, [])
    recipe = replace(run.recipe, ema=None)  # the commands write the EMA into the weights before they move
    process = build_process(recipe.diffusion, clip_range=encoded_range(encoding))
    step = TrainStep(model, recipe, encoding=encoding, mode=run.mode, process=process,
                     precision=emulated_precision(run.precision.name), device_type=PREDICTED_DEVICE)
    steps = num_inference_steps or run.sampling.num_inference_steps or recipe.diffusion.num_inference_steps
    trace = trace_sampling(step, (batch_size, 1, *run.shapes.volume), run.unet.out_channels,
                           min(steps, MAX_TRACED_DDIM_STEPS),
                           attention="flash" if run.unet.use_flash_attention else "materialised",
                           resident=[*resident, *guide_tensors], guidance_scale=float(guidance_scale),
                           covariate_dim=run.unet.covariate_dim, guide=guide, autoguide_scale=float(autoguide_scale),
                           unweight=unweight)
    # one handle: no backward runs, so the autograd thread's never exists
    ws = gpu.cublas_workspace_bytes if device_type == "cuda" else 0
    parts = {k: v + ws for k, v in trace.peaks.items()}
    model_bytes = sum(_rank_bytes(t) for t in (*model.parameters(), *model.buffers()))
    return SamplingReport(
        peak=max(parts.values()), parts=parts, resident=trace.start_bytes, model_bytes=model_bytes,
        guide_bytes=sum(_rank_bytes(t) for t in guide_tensors), batch=batch_size,
        unet_batch=batch_size * (1 if float(guidance_scale) == 1.0 else 2), inference_steps=steps, gpu=gpu.name,
        notes=tuple(notes))
