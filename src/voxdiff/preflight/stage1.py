"""GPU-free prediction of stage 1's memory: the VQ-VAE training step and the latent-cache pass.

:func:`predict_stage1` builds the config's :class:`~voxdiff.lightning.vqvae.VQVAESystem` on the ``meta`` device
and traces two of its training steps as Lightning's automatic optimisation runs them — the system's own
:meth:`~voxdiff.lightning.vqvae.VQVAESystem.training_losses` (the modalities stacked into one ``(M·B, 1, D, H, W)``
batch, MONAI's encoder, vector quantiser and decoder, MONAI's ``use_checkpointing`` when configured, the
reconstruction and VQ losses) in an emulated CUDA autocast region, then ``zero_grad`` (Lightning frees the previous
gradients after the forward, so they live through it), backward, clipping as ``trainer.gradient_clip_val`` says,
and AdamW as ``system.optim`` configures it (fused on a GPU) — with the step's machinery
(:mod:`voxdiff.preflight.memory`): :class:`~voxdiff.preflight.tracker.StorageTracker`, the autocast emulator, the
fused-AdamW stand-in, the caching-allocator replay.

The encoder and the decoder are reported apart: their forward phases, marked by the system itself, and their
backward, split where the gradient of the encoder's output is ready (a hook on it). The quantiser (MONAI runs it in
fp32 with autocast disabled) holds a few ``(latents × codes)`` matrices; its EMA codebook update is in the trace.
Not traced: the start of the codebook from the first batch and the dead-code restarts (a few latent-sized copies,
small beside the volume's activations; ``nonzero`` has no meta kernel): the steady state is traced.

The latent-cache pass (``cache_latents.py``, :func:`voxdiff.data.latents.write_latent_cache`) encodes one volume at
a time without gradients, in fp32, through :meth:`voxdiff.encodings.VQVAELatent.encode` of the frozen autoencoder:
:func:`trace_cache_pass` runs exactly that.

``evaluate.py`` on a stage-1 checkpoint reconstructs the real images a chunk at a time
(:func:`voxdiff.evaluation.pipeline.vqvae_reconstructions`): :func:`predict_reconstruction` traces two chunks of it
as that loop runs them (:func:`trace_reconstruction`, whose ``forward`` mirrors
:meth:`voxdiff.lightning.vqvae.VQVAESystem.forward`: the preflight does not import the Lightning system), so that the
command chooses ``batch_size=auto`` and refuses a chunk that does not fit before the weights go to the device.

Units: bytes; GiB = 2**30 bytes.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from voxdiff.config import compose, config_dir, instantiate_config, plain
from voxdiff.encodings.vqvae import (
    Stage1Checkpoint,
    VQVAELatent,
    VQVAESpec,
    build_vqvae,
    read_stage1_checkpoint,
    vqvae_spec,
)
from voxdiff.errors import ConfigError
from voxdiff.preflight.tracker import CUDA_CONTEXT_BYTES, DEFAULT_SAFETY_MARGIN, simulate_reserved, with_margin
from voxdiff.preflight.world import (
    PREDICTED_DEVICE,
    CudaAutocastEmulator,
    EmulatedPrecision,
    PhaseRecorder,
    PhaseTrace,
    emulated_precision,
    meta_optimizer,
    tracker_for,
)
from voxdiff.run.gpus import DEFAULT_GPU, GPUS
from voxdiff.run.spec import RunSpec, run_spec
from voxdiff.step import ClipSettings
from voxdiff.step.optim import clip_gradients, optimizer_impl
from voxdiff.units import GiB

__all__ = ["ReconstructionReport", "Stage1Report", "attach_meta_autoencoder", "latent_stage1_spec",
           "predict_reconstruction", "predict_stage1", "trace_cache_pass", "trace_reconstruction", "trace_stage1_step"]

#: the phases of a traced stage-1 step, in order
STAGE1_PHASES = ("encoder", "quantizer", "decoder", "loss", "decoder_backward", "encoder_backward", "optimizer")


def _clip(params: list[torch.Tensor], clip: ClipSettings | None) -> None:
    """The stage-1 system's gradient clipping (:func:`voxdiff.step.optim.clip_gradients`) of the optimizer's
    parameters."""
    if clip is not None:
        clip_gradients(params, clip.value, clip.algorithm)


def _optimizer_tensors(optimizer: Any) -> list[torch.Tensor]:
    return [v for st in optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)]


def trace_stage1_step(
    system: Any,
    batch: Mapping[str, Sequence[int]],
    optimizer: Any,
    precision: EmulatedPrecision,
    clip: ClipSettings | None = None,
    *,
    device_type: str = "meta",
    granularity: int | None = None,
    cuda_kernels: bool | None = None,
    steps: int = 2,
) -> list[PhaseTrace]:
    """Trace ``steps`` training steps of a :class:`~voxdiff.lightning.vqvae.VQVAESystem` in Lightning's order.

    The codebook is marked as started (the steady state; see the module docstring), so the system's forward does not
    start it from the batch.

    Args:
        system: the system, its tensors on ``device_type``, in training mode.
        batch: shapes of the batch tensors (``image``/``mask`` ``(B, 1, D, H, W)``), drawn inside the trace.
        optimizer: AdamW over the system's trainable parameters (the stand-in for fused AdamW on meta).
        precision: the emulated precision context (forward region, backward with recomputation in autocast).
        clip: ``trainer.gradient_clip_val`` / ``gradient_clip_algorithm``.
        device_type, granularity, cuda_kernels: as :func:`voxdiff.preflight.world.tracker_for`.
        steps: steps to trace (the second is the steady state: AdamW state and the previous gradients live
            through its forward).

    Returns:
        One :class:`~voxdiff.preflight.world.PhaseTrace` per step (phases :data:`STAGE1_PHASES`); ``start_bytes``
        of each is the live bytes when the trace began, ``events`` the whole trace's sequence (on the last).
    """
    system.codebook_initialised = torch.tensor(True)  # the steady state: started on the first batch of a run
    params = [p for g in optimizer.param_groups for p in g["params"]]
    tracker = tracker_for(device_type, granularity, cuda_kernels)
    rec = PhaseRecorder(tracker)
    with tracker:
        tracker.track_all([*system.parameters(), *system.buffers(), *(p.grad for p in params if p.grad is not None),
                           *_optimizer_tensors(optimizer)])
        start = tracker.live
        data = {k: torch.rand(tuple(shape), device=device_type) for k, shape in batch.items()}
        with precision.autocast:
            for _ in range(steps):
                with precision.forward():
                    out = system.training_losses(data, rec)  # Lightning's training_step returns the loss only
                loss = out["loss"]
                out["z"].register_hook(lambda grad: rec.switch("encoder_backward"))  # decoder's backward is done
                del out
                optimizer.zero_grad(set_to_none=True)  # Lightning: after the forward, before backward
                rec.begin("decoder_backward")
                precision.backward(loss)
                rec.end(rec.open or "encoder_backward")
                del loss
                rec.begin("optimizer")
                _clip(params, clip)
                precision.step(optimizer)
                rec.end("optimizer")
                rec.finish_step()
        del data
    return [PhaseTrace(peaks, start, tracker.events) for peaks in rec.steps]


def trace_cache_pass(
    encoding: VQVAELatent,
    volume: Sequence[int],
    *,
    device_type: str = "meta",
    granularity: int | None = None,
    cuda_kernels: bool | None = None,
) -> PhaseTrace:
    """Trace the latent-cache pass of one batch of one modality: ``encoding.encode`` of a ``(B, 1, D, H, W)`` volume
    on the device, without gradients (:func:`voxdiff.data.latents.write_latent_cache` encodes the image, then the
    mask, each moved to the device on its own). Phase ``encode``.

    Args:
        encoding: a :class:`~voxdiff.encodings.VQVAELatent` with its autoencoder attached, on ``device_type``.
        volume: ``(B, 1, D, H, W)``: B = ``cache_latents.py``'s ``batch_size``.
        device_type, granularity, cuda_kernels: as :func:`voxdiff.preflight.world.tracker_for`.
    """
    ae = encoding.autoencoder
    tracker = tracker_for(device_type, granularity, cuda_kernels)
    rec = PhaseRecorder(tracker)
    # the pass runs in fp32; the emulator (disabled) only stands in for the torch.autocast(enabled=False) it opens
    with tracker, CudaAutocastEmulator(device_type=device_type, enabled=False), torch.no_grad():
        tracker.track_all([*ae.parameters(), *ae.buffers()])
        start = tracker.live
        rec.begin("encode")
        z = encoding.encode(torch.rand(tuple(volume), device=device_type))
        del z
        rec.end("encode")
    return PhaseTrace(rec.finish_step(), start, tracker.events)


def trace_reconstruction(
    ae: torch.nn.Module,
    volume: Sequence[int],
    *,
    device_type: str = "meta",
    granularity: int | None = None,
    cuda_kernels: bool | None = None,
) -> PhaseTrace:
    """Trace two chunks of ``evaluate.py``'s VQ-VAE loop (:func:`voxdiff.evaluation.pipeline.vqvae_reconstructions`)
    as it runs them, without gradients, in fp32: the images to the device, the system's forward (encode, quantise,
    decode; the latents let go with its tuple), the reconstruction clamped (the copy sent to the host), then the code
    indices of the images and of the masks; nothing of a chunk stays on the device into the next. Phases
    ``reconstruct`` and ``codes``, the larger peak of the two chunks each.

    Args:
        ae: the frozen autoencoder (MONAI's ``VQVAE``, the system's ``vqvae``) on ``device_type``.
        volume: ``(B, 1, D, H, W)``: B = ``evaluate.py``'s ``batch_size``.
        device_type, granularity, cuda_kernels: as :func:`voxdiff.preflight.world.tracker_for`.
    """
    tracker = tracker_for(device_type, granularity, cuda_kernels)
    rec = PhaseRecorder(tracker)

    def forward(x: torch.Tensor) -> tuple[torch.Tensor, ...]:  # VQVAESystem.forward
        z = ae.encode(x)
        q, vq_loss = ae.quantize(z)
        return ae.decode(q), z, q, vq_loss

    with tracker, CudaAutocastEmulator(device_type=device_type, enabled=False), torch.no_grad():
        tracker.track_all([*ae.parameters(), *ae.buffers()])
        start = tracker.live
        for _ in range(2):
            rec.begin("reconstruct")
            x = torch.rand(tuple(volume), device=device_type)
            recon = forward(x)[0]
            clamped = recon.float().clamp(0, 1)
            del recon, clamped
            rec.end("reconstruct")
            rec.begin("codes")
            codes = ae.index_quantize(x)
            mask = torch.rand(tuple(volume), device=device_type)
            mask_codes = ae.index_quantize(mask)
            del codes, mask, mask_codes, x
            rec.end("codes")
    return PhaseTrace(rec.finish_step(), start, tracker.events)


@dataclass(frozen=True)
class ReconstructionReport:
    """Predicted peak device memory (``max_memory_allocated``, the cuBLAS workspace included on a GPU) of
    ``evaluate.py`` reconstructing ``batch`` volumes at once with a VQ-VAE (:func:`predict_reconstruction`).

    Attributes:
        peak: the larger of ``parts`` (``reconstruct``, ``codes``: each phase's peak, the weights included).
        parts: phase name -> peak bytes.
        resident: the weights and buffers on the device.
        batch: volumes per chunk; volume: ``(D, H, W)``.
        gpu: the GPU type predicted for ("the CPU" on the host).
    """

    peak: int
    parts: dict[str, int]
    resident: int
    batch: int
    volume: tuple[int, ...]
    gpu: str

    def required_bytes(self, safety_margin: float = DEFAULT_SAFETY_MARGIN) -> int:
        """Device memory the command's tensors need: ``peak * (1 + safety_margin)`` (the CUDA context aside)."""
        return with_margin(self.peak, safety_margin)

    def describe(self) -> str:
        phase = max(self.parts, key=self.parts.get)
        return (f"peak {self.peak / GiB:.3g} GiB in {phase} (batch {self.batch} of {'x'.join(map(str, self.volume))}; "
                f"weights {self.resident / GiB:.3g} GiB)")


def predict_reconstruction(spec: VQVAESpec, batch_size: int, volume: Sequence[int],
                           device_type: str = PREDICTED_DEVICE, gpu: Any = None) -> ReconstructionReport:
    """Predict the peak device memory of ``evaluate.py`` reconstructing ``batch_size`` volumes of ``volume``
    ``(D, H, W)`` at once with a VQ-VAE of ``spec``, without a GPU (:func:`trace_reconstruction` on meta).

    Args:
        device_type: where the command runs: ``cuda`` counts ``gpu``'s cuBLAS workspace, ``cpu`` none.
        gpu: the :class:`~voxdiff.run.gpus.GpuSpec` of the device (None: the default GPU type).
    """
    gpu = gpu if gpu is not None else GPUS[DEFAULT_GPU]
    with torch.device("meta"):
        ae = build_vqvae(VQVAESpec(**{**asdict(spec), "use_checkpoint": False})).eval().requires_grad_(False)
    trace = trace_reconstruction(ae, (batch_size, 1, *volume))
    ws = gpu.cublas_workspace_bytes if device_type == "cuda" else 0
    parts = {k: v + ws for k, v in trace.peaks.items()}
    return ReconstructionReport(peak=max(parts.values()), parts=parts, resident=trace.start_bytes,
                                batch=batch_size, volume=tuple(volume),
                                gpu=gpu.name if device_type == "cuda" else "the CPU")


def latent_stage1_spec(encoding: VQVAELatent) -> tuple[VQVAESpec, str]:
    """The stage-1 architecture of a latent run's encoding: from its checkpoint (``encoding.checkpoint``) when that
    file exists, else from the stage-1 experiment of its factor (``configs/experiment/vqvae_<factor>x.yaml``).
    Returns the spec and a note saying which."""
    ckpt, factor = encoding.checkpoint, encoding.factor
    if ckpt and Path(str(ckpt)).is_file():
        return read_stage1_checkpoint(ckpt).spec, f"stage-1 architecture from encoding.checkpoint={ckpt}"
    name = f"vqvae_{factor}x"
    if not (config_dir() / "experiment" / f"{name}.yaml").is_file():
        raise ConfigError("encoding.checkpoint", ckpt, f"the preflight needs the stage-1 architecture and there is "
                          f"no experiment={name} to take it from", "point encoding.checkpoint at the stage-1 checkpoint")
    stage1 = compose("train", [f"experiment={name}"])
    return (vqvae_spec(**plain(stage1.system.vqvae)),
            f"stage-1 architecture of experiment={name} (encoding.checkpoint={ckpt} is not a file)")


def attach_meta_autoencoder(encoding: VQVAELatent, spec: VQVAESpec) -> VQVAELatent:
    """Give ``encoding`` an untrained autoencoder of ``spec`` on the meta device, built as
    :meth:`VQVAELatent.load_weights` builds it for inference (no checkpointing, eval mode, frozen)."""
    spec = VQVAESpec(**{**asdict(spec), "use_checkpoint": False})
    with torch.device("meta"):
        ae = build_vqvae(spec)
    return encoding.attach(ae, Stage1Checkpoint(path="(preflight: untrained, on meta)", spec=spec, state={},
                                                latent_scale=1.0, sha256="", volume_shape=None))


@dataclass(frozen=True)
class Stage1Report:
    """Predicted GPU memory of stage 1 (``max_memory_allocated``, cuBLAS workspaces included), in bytes.

    Attributes:
        params: parameters of the VQ-VAE (the codebook included); param_bytes: its weights and buffers.
        batch_shape: ``(M·B, 1, D, H, W)``: the modalities stacked into one batch of the autoencoder.
        latent_shape: ``(M·B, latent_channels, d, h, w)``.
        precision, optimizer, use_checkpoint: as traced.
        first_step, steady_step: peak per phase (:data:`STAGE1_PHASES`) of step 1 and of a later step.
        encoder, quantizer, decoder: the largest peak while each part runs (forward, and backward for encoder and
            decoder; the decoder's includes the reconstruction loss), over both steps.
        optimizer_peak: peak of clipping and ``optimizer.step()``.
        peak_allocated: the training step's peak.
        cache_pass: peak of encoding one volume for the latent cache (``cache_batch`` subjects, one modality).
        estimated_reserved: the caching allocator's segments (training step), workspaces included.
        gpu, cuda_context_bytes, trace_seconds, notes: as in :class:`~voxdiff.preflight.memory.MemoryReport`.
    """

    params: int
    param_bytes: int
    batch_shape: tuple[int, ...]
    latent_shape: tuple[int, ...]
    precision: str
    optimizer: str
    use_checkpoint: bool
    first_step: dict[str, int]
    steady_step: dict[str, int]
    encoder: int
    quantizer: int
    decoder: int
    optimizer_peak: int
    peak_allocated: int
    cache_pass: int
    cache_batch: int
    estimated_reserved: int
    gpu: str
    cuda_context_bytes: int = CUDA_CONTEXT_BYTES
    trace_seconds: float = 0.0
    notes: tuple[str, ...] = field(default_factory=tuple)

    def describe(self) -> str:
        """One line: the step's peak and its parts, the cache pass, in GiB."""
        return (f"stage 1 VQ-VAE ({self.params / 1e6:.1f} M params, batch {self.batch_shape}, {self.precision}, "
                f"{self.optimizer}, use_checkpoint={str(self.use_checkpoint).lower()}): step peak "
                f"{self.peak_allocated / GiB:.2f} GiB (encoder {self.encoder / GiB:.2f}, quantizer "
                f"{self.quantizer / GiB:.2f}, decoder {self.decoder / GiB:.2f}, optimizer {self.optimizer_peak / GiB:.2f}),"
                f" reserved ~{self.estimated_reserved / GiB:.2f} GiB | latent cache pass {self.cache_pass / GiB:.2f} GiB "
                f"(B={self.cache_batch}) on {self.gpu}")


def _with_workspaces(peaks: dict[str, int], ws: int, first: bool) -> dict[str, int]:
    """The cuBLAS workspaces on top of traced peaks, as the step's prediction adds them: one handle (the main
    thread's) in the first forward, the autograd thread's too from the first backward on."""
    forward = {"encoder", "quantizer", "decoder", "loss"}
    return {k: v + (ws if first and k in forward else 2 * ws) for k, v in peaks.items()}


def predict_stage1(cfg: DictConfig, run: RunSpec | None = None, cache_batch: int = 1) -> Stage1Report:
    """Predict the peak GPU memory of the stage-1 run ``cfg`` (``experiment=vqvae_*``) and of its latent-cache pass,
    without a GPU (a few seconds).

    Args:
        cfg: a composed ``train``/``preflight`` config whose system is the VQ-VAE (its ``system`` node is the
            system built, from the run spec's part, as ``train.py`` builds it).
        run: its run spec when already resolved (:func:`voxdiff.run.spec.run_spec`): the GPU type, the precision,
            the volume, the batch and the clipping are its; else it is resolved for a GPU here.
        cache_batch: ``cache_latents.py``'s ``batch_size`` (volumes encoded together; default 1).

    Raises:
        ConfigError: not a stage-1 config, or a setting that cannot work (named key, value and fix).
    """
    run = run or run_spec(cfg, PREDICTED_DEVICE)
    if run.kind != "stage1":
        raise ConfigError("system.kind", run.kind, "is not a VQ-VAE stage 1", "use experiment=vqvae_4x or "
                          "vqvae_8x (or voxdiff.preflight.memory.predict_phases for a diffusion run)")
    t0 = time.perf_counter()
    spec_gpu = run.gpu
    vol, bs = run.shapes.volume, run.batch_size
    with torch.device("meta"):
        system = instantiate_config(cfg.system, _partial_=True)(spec=run.system)
    system.train()
    batch = {m: (bs, 1, *vol) for m in system.hparams.modalities}
    precision = run.precision.name
    trainable = [p for p in system.vqvae.parameters() if p.requires_grad]
    impl = optimizer_impl(system.optim_settings, "cuda")  # meta stands for a GPU
    optimizer = meta_optimizer(trainable, system.optim_settings, impl)
    steps = trace_stage1_step(system, batch, optimizer, emulated_precision(precision), run.clip)

    encoding = attach_meta_autoencoder(VQVAELatent(system.spec.factor, system.spec.latent_channels), system.spec)
    cache = trace_cache_pass(encoding, (cache_batch, 1, *vol))

    ws = spec_gpu.cublas_workspace_bytes
    first, steady = _with_workspaces(steps[0].peaks, ws, True), _with_workspaces(steps[1].peaks, ws, False)

    def part(*names: str) -> int:
        return max(s[n] for s in (first, steady) for n in names)

    m, k, f = len(batch) * bs, system.spec.latent_channels, system.spec.factor
    reserved, _ = simulate_reserved(steps[-1].events)
    param_bytes = sum(t.numel() * t.element_size() for t in [*system.parameters(), *system.buffers()])
    return Stage1Report(
        params=sum(p.numel() for p in system.vqvae.parameters()),
        param_bytes=param_bytes,
        batch_shape=(m, 1, *vol),
        latent_shape=(m, k, *(s // f for s in vol)),
        precision=precision,
        optimizer=f"AdamW({impl})",
        use_checkpoint=system.spec.use_checkpoint,
        first_step=first,
        steady_step=steady,
        encoder=part("encoder", "encoder_backward"),
        quantizer=part("quantizer"),
        decoder=part("decoder", "loss", "decoder_backward"),
        optimizer_peak=part("optimizer"),
        peak_allocated=max(*first.values(), *steady.values()),
        cache_pass=cache.peak + ws,
        cache_batch=cache_batch,
        estimated_reserved=reserved + 2 * ws,
        gpu=spec_gpu.name,
        trace_seconds=time.perf_counter() - t0,
        notes=("the codebook's start from the first batch and the dead-code restarts are not traced (a few "
               "latent-sized copies)", "cuDNN convolution workspaces are not modelled"),
    )
