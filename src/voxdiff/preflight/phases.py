"""GPU-free prediction of the memory of a diffusion run's validation and sampling, beside its training step.

A run does more than its training step (:mod:`voxdiff.preflight.memory`): every validation epoch the system swaps
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
Units: bytes; GiB = 2**30 bytes.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from omegaconf import DictConfig

from voxdiff.diffusion import build_process, encoded_range
from voxdiff.encodings.base import LearnedEncoding
from voxdiff.errors import ConfigError
from voxdiff.preflight.tracker import CUDA_CONTEXT_BYTES
from voxdiff.preflight.attention import FlashAttentionEmulator
from voxdiff.preflight.memory import MemoryReport, diffusion_run, predict_memory, traced_unet
from voxdiff.preflight.stage1 import attach_meta_autoencoder, latent_stage1_spec
from voxdiff.preflight.world import PhaseRecorder, PhaseTrace, meta_step, tracker_for
from voxdiff.run.spec import RunSpec
from voxdiff.step import TrainStep
from voxdiff.units import GiB

__all__ = ["PhasesReport", "predict_phases", "trace_sampling", "trace_validation"]

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
    """
    with _traced(step, resident, attention, device_type, granularity, cuda_kernels) as (rec, trace):
        mask = torch.rand(tuple(mask_shape), device=device_type).round_()  # {0, 1}, as the cached masks
        covariates = torch.rand((mask_shape[0], covariate_dim), device=device_type) if covariate_dim else None
        with step.precision.autocast.region():
            out = step.generate(mask, out_channels, num_inference_steps, probe=rec, guidance_scale=guidance_scale,
                                covariates=covariates)
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
        val_batch, val_timesteps: ``data.batch_size`` and ``system.val_timesteps``.
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

    val_batch = dict(batch)
    if "image_z" in val_batch and run.resources.masks:  # latent batches carry the full-size mask
        val_batch["mask"] = (batch["image_z"][0], 1, *run.shapes.volume)
    validation = trace_validation(step, val_batch, val_timesteps, attention=attention, resident=resident)
    sampling = run.sampling
    mask_shape = (max(min(num_masks, sampling.batch_size), 1), 1, *run.shapes.volume)
    sample = trace_sampling(step, mask_shape, run.unet.out_channels, min(steps, MAX_TRACED_DDIM_STEPS),
                            attention=attention, resident=resident, guidance_scale=float(sampling.guidance_scale),
                            covariate_dim=run.unet.covariate_dim)

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
        resident=validation.start_bytes, swap_bytes=swap, val_batch=batch[next(iter(batch))][0],
        val_timesteps=val_timesteps, sample_batch=mask_shape[0] * (1 if float(sampling.guidance_scale) == 1.0 else 2),
        inference_steps=steps,
        peak_allocated=peaks[phase], peak_phase=phase, training_report=training, gpu=gpu.name,
        trace_seconds=time.perf_counter() - t0, notes=tuple(notes),
    )
