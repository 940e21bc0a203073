"""One training step of a diffusion UNet, written once, without Lightning.

:class:`TrainStep` holds the model, the loss of a batch, the optimizer, the gradient order, clipping and the
non-finite guard, the EMA and the precision context, as a :class:`~voxdiff.step.recipe.Recipe` describes them.
Three drivers run it:

* the Lightning system (``voxdiff.lightning.diffusion``) calls its parts from its hooks — ``training_step`` →
  :meth:`TrainStep.loss`, ``optimizer_zero_grad`` → :meth:`TrainStep.zero_grad_before_backward`, ``backward`` →
  :meth:`TrainStep.compile_errors`, ``configure_gradient_clipping`` → :meth:`TrainStep.clip_and_check`,
  ``optimizer_step`` → :meth:`TrainStep.after_optimizer_step` — while Lightning does the autocast, the backward
  and ``step()``;
* the preflight traces :meth:`TrainStep.run` on meta tensors, with its CUDA-autocast emulator as the precision
  context (``voxdiff.preflight.memory``);
* ``preflight.measure=true`` runs :meth:`TrainStep.run` on a GPU (``voxdiff.benchmarks.measure``).

One step (:meth:`TrainStep.run`), in Lightning's order::

    forward   batch ──encode_batch──▶ x0 (B, C_out, d, h, w), cond (B, C_cond, d, h, w) | None
              ──loss (under the precision context; the model compiled with model.compile)──▶ fp32 loss ──▶ guard
    [zero_grad]                                          (recipe.zero_grad_at == "before_backward")
    backward  loss.backward()
    optimizer [unscale] ──clip, grad norm──▶ guard ──▶ optimizer.step() ──▶ EMA update ──▶ [zero_grad] ("after_step")
              ──▶ every system.guard.check_every_n_steps: check the guard (one host sync)

No step makes the host wait for the device otherwise: the guard records a non-finite loss or gradient norm on
the device (:mod:`voxdiff.step.guard`), clipping and the EMA are device kernels, and the statistics returned are
tensors. With a fused AdamW, clipping by norm is the norm alone: its factor goes into the optimizer's kernel
(:func:`voxdiff.step.optim.clip_gradients`), with no pass of its own over the gradients.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from typing import Any, Protocol

import torch
from torch import nn

from voxdiff.diffusion import build_process, decode_volume, encode_batch, encode_volume
from voxdiff.diffusion.batch import mask_loss_weights, mask_weight_to_undo, model_input, unweighted_mask_prediction
from voxdiff.diffusion.guidance import autoguided, drop_conditions, with_covariates
from voxdiff.diffusion.processes import Process
from voxdiff.diffusion.seed import seed_loss
from voxdiff.encodings.base import Encoding, LearnedEncoding
from voxdiff.encodings.identity import Identity
from voxdiff.step.compiling import CompiledForward, CompileSettings
from voxdiff.step.ema import EMA
from voxdiff.step.guard import FiniteGuard, NonFiniteLossError
from voxdiff.step.optim import (build_lr_scheduler, build_optimizer, clip_gradients, optimizer_impl,
                                params_device_type, unfold_clip)
from voxdiff.step.precision import Precision, PrecisionContext
from voxdiff.step.recipe import Recipe

__all__ = ["NonFiniteLossError", "PhaseProbe", "TrainStep", "batch_shapes"]

LossFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
"""``loss_fn(model, x0, cond) -> (loss, stats)``: the diffusion process's ``loss`` or the seed's loss."""


class PhaseProbe(Protocol):
    """Called around the three phases of :meth:`TrainStep.run` (``forward``, ``backward``, ``optimizer``): the
    preflight's storage tracker and the measure mode's CUDA peak statistics."""

    def begin(self, phase: str) -> None: ...

    def end(self, phase: str) -> None: ...


class _NoProbe:
    def begin(self, phase: str) -> None:
        pass

    def end(self, phase: str) -> None:
        pass


class TrainStep:
    """The training step of ``model`` as ``recipe`` describes it.

    Args:
        model: the denoiser, called as ``model(x, timesteps=t)``.
        recipe: loss, optimizer, gradient order, clipping, guard, EMA (:mod:`voxdiff.step.recipe`).
        encoding: turns data batches into what the UNet sees (:func:`voxdiff.diffusion.encode_batch`); default
            identity (batches that carry ``image_z``/``mask_z`` are used as they are anyway).
        mode: ``bravo`` (image conditioned on the mask) or ``seg``.
        process: the diffusion process whose loss is used (the system passes its own, which also samples);
            default: one built from ``recipe.diffusion``, or the seed's loss when that is None.
        precision: the precision context of :meth:`run` (default: no autocast); Lightning brings its own.
        device_type: the device the run is on (``cuda``/``cpu``), which picks the AdamW implementation when
            ``system.optim`` leaves it open; default: the device of the model's parameters when the optimizer is
            made (Lightning moves the model to the GPU before ``configure_optimizers``). The preflight passes
            ``cuda`` for its meta tensors, which stand for a GPU.
        compile: compile the training forward (:class:`~voxdiff.step.compiling.CompiledForward`); None: eager.

    Attributes:
        optimizer, scheduler: set by :meth:`configure_optimizer`.
        clip, zero_grad_at: from the recipe; the Lightning system sets ``clip`` from its Trainer.
        guard: the :class:`~voxdiff.step.guard.FiniteGuard` (its ``any_rank`` reduces over processes), or None.
        ema: the :class:`~voxdiff.step.ema.EMA`, or None (``system.ema: false``).
        compiled: the :class:`~voxdiff.step.compiling.CompiledForward`, or None.
        loss_scaled: a loss scaler (fp16) skips non-finite gradients itself: the gradient-norm guard is off.
    """

    def __init__(
        self,
        model: nn.Module,
        recipe: Recipe,
        *,
        encoding: Encoding | None = None,
        mode: str = "bravo",
        process: Process | None = None,
        precision: PrecisionContext | None = None,
        device_type: str | None = None,
        compile: CompileSettings | None = None,
    ) -> None:
        self.model = model
        self.recipe = recipe
        self.encoding = encoding if encoding is not None else Identity()
        self.mode = mode
        if process is None and recipe.diffusion is not None:
            process = build_process(recipe.diffusion)
        self.process = process
        self.loss_fn: LossFn = process.loss if process is not None else seed_loss
        self._device_type = device_type
        self.precision = precision if precision is not None else Precision("32-true", "cpu").context()
        self.loss_scaled = self.precision.scales_loss
        self.zero_grad_at = recipe.zero_grad_at
        self.clip = recipe.clip
        self.guard = FiniteGuard(recipe.guard) if recipe.guard is not None else None
        self.ema = (EMA(model, recipe.ema.decay, recipe.ema.start_step, recipe.ema.every_n_steps)
                    if recipe.ema is not None else None)
        self.compiled = CompiledForward(model, compile) if compile is not None else None
        self.optimizer: Any = None
        self.scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
        self.steps_done = 0

    # ------------------------------------------------------------------ set-up
    @property
    def device_type(self) -> str:
        """The device type the step runs on: as given, else that of the model's parameters now (``mixed`` when
        they are not all on one device type)."""
        return self._device_type or params_device_type(self.model.parameters())

    @property
    def train_model(self) -> Callable[..., torch.Tensor]:
        """What the training loss calls: the compiled forward with ``model.compile``, else the model. Validation,
        sampling and the EMA use :attr:`model`, always eager."""
        return self.compiled.module if self.compiled is not None else self.model

    @property
    def optimizer_impl(self) -> str:
        """``foreach``, ``fused`` or ``single``: :func:`voxdiff.step.optim.optimizer_impl` on this device."""
        return optimizer_impl(self.recipe.optim, self.device_type)

    def configure_optimizer(
        self, total_steps: float | None = None, optimizer: Any = None
    ) -> tuple[Any, torch.optim.lr_scheduler.LRScheduler | None]:
        """Build AdamW over the model's trainable parameters (:func:`~voxdiff.step.optim.build_optimizer` with
        :attr:`optimizer_impl`) and, given the run length ``total_steps``, its warm-up/cosine schedule.

        Args:
            total_steps: optimizer steps of the run (inf: unbounded); None: no schedule (a constant ``lr``).
            optimizer: use this optimizer instead (the preflight's stand-in for fused AdamW, which refuses meta
                tensors); it needs ``param_groups``, ``state``, ``step()`` and ``zero_grad(set_to_none=True)``.

        Raises:
            ConfigError: an unbounded run without ``system.optim.decay_steps``.
        """
        if optimizer is None:
            optimizer = build_optimizer(self.model.parameters(), self.recipe.optim, self.optimizer_impl)
        self.optimizer = optimizer
        self.scheduler = None
        if total_steps is not None:
            self.scheduler = build_lr_scheduler(self.optimizer, self.recipe.optim, total_steps)
        return self.optimizer, self.scheduler

    def to(self, device: torch.device | str) -> TrainStep:
        """Keep what the step owns besides the model (the EMA) on ``device``."""
        if self.ema is not None:
            self.ema.to(device)
        return self

    def fold_ema(self, use_ema: bool) -> None:
        """Keep one copy of the weights, frozen, as sampling outside training needs: the EMA's written into the model
        when ``use_ema`` (the raw ones kept otherwise), the EMA dropped, and ``requires_grad`` off. :meth:`generate`
        then samples those weights whatever its ``use_ema``. Call it before the model goes to the device: the device
        never holds the EMA's copy (a whole fp32 UNet: 10.7 GB for exp9's 2.7B parameters), and autocast keeps no
        bf16 copy of frozen weights under ``torch.no_grad()`` (it does of weights that require gradients: another
        half of the fp32 weights while a sample is drawn)."""
        if self.ema is not None and use_ema:
            self.ema.copy_to(self.model)
        self.ema = None
        self.model.requires_grad_(False)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the step keeps between steps: weights, buffers, gradients, optimizer state, EMA."""
        out = [*self.model.parameters(), *self.model.buffers()]
        out += [p.grad for p in self.model.parameters() if p.grad is not None]
        state = getattr(self.optimizer, "state", {})
        out += [v for st in state.values() for v in st.values() if isinstance(v, torch.Tensor)]
        if self.ema is not None:
            out += self.ema.shadow
        return out

    # ------------------------------------------------------------------ the parts
    def loss(self, batch: Mapping[str, Any], step: int | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss of a data batch (run it under the precision context: :meth:`run`, or Lightning's); the guard
        records it if it is not finite (no host sync).

        Args:
            batch: ``image``/``mask`` volumes ``(B, 1, D, H, W)`` or their encodings ``image_z``/``mask_z``.
            step: the global step, for the guard's record (default: the steps :meth:`run` has done).

        Returns:
            ``(loss, stats)``: a float32 scalar with grad, and detached statistics of the loss function.

        Raises:
            CompileFailed: compiling the training forward failed (``model.compile``).
        """
        x0, cond = self.encoded(batch)  # (B, C_out, d, h, w), (B, C_cond, ...) | None
        extra = {}
        mask_weight = self.mask_weight
        if mask_weight:  # the mask's voxels count more (B, 1, d, h, w); computed before the condition is dropped
            extra["weights"] = mask_loss_weights(batch, x0, mask_weight)
        covariates = batch.get("covariates")  # (B, K) with data.covariates, else None
        if self.recipe.guidance is not None:  # classifier-free guidance: the null mask and covariates, jointly
            cond, covariates = drop_conditions(cond, covariates, self.recipe.guidance.drop_prob)
        if self.compiled is not None:
            self.compiled.start()
        with self.compile_errors():
            loss, stats = self.loss_fn(with_covariates(self.train_model, covariates), x0, cond, **extra)
        if self.guard is not None:
            self.guard.record("loss", loss, self.steps_done if step is None else step)
        return loss, stats

    @contextmanager
    def compile_errors(self) -> Iterator[None]:
        """Around code that runs compiled graphs (the loss, the backward, whose graph compiles lazily on the first
        step): a compiler failure becomes :class:`~voxdiff.step.compiling.CompileFailed`."""
        with self.compiled.errors() if self.compiled is not None else nullcontext():
            yield

    def zero_grad_before_backward(self) -> None:
        """Free the previous step's gradients here if the recipe frees them before backward (else they are gone
        already: :meth:`after_optimizer_step`)."""
        if self.zero_grad_at == "before_backward":
            self.optimizer.zero_grad(set_to_none=True)

    def clip_and_check(self, step: int | None = None) -> torch.Tensor | None:
        """Clip the gradients as ``clip`` says and record a non-finite total norm in the guard, before the
        optimizer step, without a host sync. Returns the norm before clipping (a device scalar), or None when
        neither clipping nor the guard needs it."""
        guard = self.guard is not None and not self.loss_scaled
        if self.clip is None and not guard:
            return None
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        if self.clip is None:  # the guard alone: the norm, nothing clipped
            norm = clip_gradients(params, None)
        else:  # a fused AdamW takes the factor of clipping by norm into its own kernel (not under a loss scaler)
            norm = clip_gradients(params, self.clip.value, self.clip.algorithm,
                                  optimizer=None if self.loss_scaled else self.optimizer)
        if guard:
            self.guard.record("gradient norm", norm, self.steps_done if step is None else step)
        return norm

    def after_optimizer_step(self, step: int | None = None) -> float | None:
        """The post-step hooks: the clipping factor a fused AdamW was given is dropped; the EMA update (once per
        optimizer step); then, if the recipe says so, free the gradients now rather than before the next backward
        (they would live through the next forward: 4 bytes per parameter of the peak); then the end of the compile
        warm-up; then the guard's check when one is due after global step ``step`` (default: the steps :meth:`run`
        has done).

        Returns:
            The seconds of the compile warm-up when this step ended it, else None.

        Raises:
            NonFiniteLossError: a check found a non-finite loss or gradient norm since the start.
        """
        unfold_clip(None if self.loss_scaled else self.optimizer)
        if self.ema is not None:
            self.ema.update(self.model)
        if self.zero_grad_at == "after_step":
            self.optimizer.zero_grad(set_to_none=True)
        warmup = self.compiled.finish() if self.compiled is not None else None
        step = self.steps_done if step is None else step
        if self.guard is not None and self.guard.due(step):
            self.guard.check()
        return warmup

    def check_guard(self, detail: str = "") -> None:
        """Check the guard now (one host sync; on every rank): before a checkpoint is written, before validation,
        at the end of training. Raises :class:`NonFiniteLossError` if any step so far was not finite."""
        if self.guard is not None:
            self.guard.check(detail)

    @contextmanager
    def ema_weights(self) -> Iterator[nn.Module]:
        """``with step.ema_weights(): ...`` runs the model with the EMA weights (the raw ones without an EMA)."""
        with self.ema.swapped(self.model) if self.ema is not None else nullcontext(self.model):
            yield self.model

    # ------------------------------------------------------------------ validation and sampling
    def validation_loss(
        self, batch: Mapping[str, Any], num_timesteps: int, generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, int]:
        """The validation loss of a batch with the EMA weights: the mean of the loss at ``num_timesteps`` fixed,
        evenly spread timesteps (fixed noise with a fixed ``generator``), so it is comparable from epoch to epoch.
        Run it without gradients (Lightning's validation loop, the preflight's trace).

        Returns:
            ``(loss, batch size)``: a float32 scalar and the number of samples in the batch.
        """
        process = self._require_process("validation_loss")
        x0, cond = self.encoded(batch)  # (B, C_out, d, h, w), (B, C_cond, ...) | None
        n, b = num_timesteps, x0.shape[0]
        timesteps = ((torch.arange(n, device=x0.device) + 0.5) * (process.num_train_timesteps / n)).long()
        model = with_covariates(self.model, batch.get("covariates"))  # (B, K) with data.covariates
        with self.ema_weights():
            losses = [process.loss(model, x0, cond, generator=generator, timesteps=t.expand(b))[0]
                      for t in timesteps]
        return torch.stack(losses).mean(), b

    @torch.no_grad()
    def generate(
        self,
        mask: torch.Tensor,
        out_channels: int,
        num_inference_steps: int | None = None,
        generator: torch.Generator | None = None,
        eta: float | None = None,
        use_ema: bool = True,
        probe: PhaseProbe | None = None,
        guidance_scale: float = 1.0,
        batch_size: int | None = None,
        covariates: torch.Tensor | None = None,
        guide: nn.Module | None = None,
        autoguide_scale: float = 1.0,
        guidance_interval: tuple[float, float] | None = None,
        unweight: bool = True,
    ) -> torch.Tensor:
        """Samples (DDIM, or Euler for rectified flow) decoded to volumes, with the EMA weights swapped in (by
        default), on ``mask``'s device.

        Args:
            mask: ``(B, 1, D, H, W)`` masks in {0, 1}: the condition in bravo mode; in seg mode only its shape is used.
            out_channels: channels the UNet predicts (those of the image encoding in bravo mode).
            num_inference_steps: sampling steps (None: the diffusion's).
            generator: generator of the initial noise (on ``mask``'s device), drawn from chunk by chunk.
            eta: DDIM's (or rectified flow's) stochasticity (None: the diffusion's).
            use_ema: sample with the EMA weights (swapped in once for all chunks, and restored).
            probe: told where the ``condition`` (encoding the masks), ``sampling`` (the sampler's loop) and
                ``decode`` phases begin and end (the preflight's memory probe).
            guidance_scale: classifier-free guidance (:mod:`voxdiff.diffusion.guidance`): 1 samples the conditional
                model alone; any other scale runs the conditional and unconditional halves as one batch of 2×.
            batch_size: masks sampled at once (None: all B); the peak memory is that of one chunk.
            covariates: ``(B, K)`` covariate vectors, one per mask (a model trained with ``data.covariates``).
            guide: the same UNet less trained (its weights as they are: the caller puts its EMA in), for
                autoguidance (:func:`voxdiff.diffusion.guidance.autoguided`); None: none.
            autoguide_scale: how far the prediction is pushed away from the guide's (1: the model alone).
            guidance_interval: ``[lo, hi]`` (``t / T``) of the steps either guidance runs at (None: every step;
                :func:`voxdiff.diffusion.guidance.step_denoisers`).
            unweight: where :attr:`unweights_samples`, undo the mask weight's bias of each predicted x₀
                (:func:`voxdiff.diffusion.batch.unweighted_mask_prediction`); False: sample the weighted model as
                it is (what every sample was before session 34).

        Returns:
            ``(B, 1, D, H, W)`` float32: images in [0, 1] (bravo) or masks in {0, 1} (seg).
        """
        process = self._require_process("generate")
        if guide is not None:
            guide.eval()
        sampled = autoguided(self.model, guide, autoguide_scale)  # the model itself without a guide
        probe = probe or _NoProbe()
        chunk = batch_size or mask.shape[0]
        was_training = self.model.training
        self.model.eval()
        outs = []
        try:
            with self.ema_weights() if use_ema else nullcontext():
                covs = covariates.split(chunk) if covariates is not None else [None] * len(mask.split(chunk))
                for part, cov in zip(mask.split(chunk), covs, strict=True):
                    outs.append(self._generate_chunk(process, part, out_channels, num_inference_steps, generator,
                                                     eta, probe, guidance_scale, cov, sampled, guidance_interval,
                                                     unweight and self.unweights_samples))
        finally:
            self.model.train(was_training)
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    def _generate_chunk(self, process: Process, mask: torch.Tensor, out_channels: int, num_inference_steps: int | None,
                        generator: torch.Generator | None, eta: float | None, probe: PhaseProbe,
                        guidance_scale: float, covariates: torch.Tensor | None,
                        model: Callable[..., torch.Tensor],
                        guidance_interval: tuple[float, float] | None = None,
                        unweight: bool = False) -> torch.Tensor:
        """:meth:`generate` of one chunk of masks ``(b, 1, D, H, W)`` and covariates ``(b, K)`` or None (the model in
        eval mode, weights in place; ``model``: what the sampler calls, the UNet or its autoguided mix;
        ``unweight``: undo the mask weight's bias of each predicted x₀)."""
        probe.begin("condition")
        if self.mode == "bravo":
            cond = encode_volume(self.encoding, mask)  # (b, C, d, h, w)
            spatial = tuple(cond.shape[2:])
        else:
            cond = None
            spatial = self.encoding.encoded_shape((1, *mask.shape[2:]))[1:]
        probe.end("condition")
        probe.begin("sampling")
        z = process.sample(model, (mask.shape[0], out_channels, *spatial), cond, num_inference_steps,
                           generator=generator, device=mask.device, eta=eta, guidance_scale=guidance_scale,
                           guidance_interval=guidance_interval, x0_map=self._unweighting() if unweight else None,
                           **({} if covariates is None else {"covariates": covariates.to(mask.device)}))
        probe.end("sampling")
        del cond
        probe.begin("decode")
        out = decode_volume(self.encoding, z, "image" if self.mode == "bravo" else "mask")
        probe.end("decode")
        return out

    @torch.no_grad()
    def denoised(self, batch: Mapping[str, Any], fraction: float, generator: torch.Generator | None = None,
                 covariates: torch.Tensor | None = None, unweight: bool = True) -> torch.Tensor:
        """The model's one-step estimate of clean volumes from real ones noised at ``fraction`` of the schedule
        (0 clean, 1 pure noise): what it makes of a lesion it is shown (``evaluate.py``'s denoising figures). The
        weights as they are (the commands fold the EMA in first), run in eval mode.

        Args:
            batch: ``image`` and ``mask`` ``(B, 1, D, H, W)`` (what :func:`voxdiff.diffusion.encode_batch` takes):
                the mode's target is noised, a bravo model's mask is its condition.
            fraction: where on the schedule (the process's ``timestep_at``).
            generator: of the noise (on the batch's device).
            covariates: ``(B, K)`` of a model trained with covariates (the subjects' own).
            unweight: undo a mask model's weight (:attr:`unweights_samples`), as its sampler does.

        Returns:
            ``(B, 1, D, H, W)`` float32 decoded as :meth:`generate` decodes: images in [0, 1] (bravo) or masks in
            {0, 1} (seg).
        """
        process = self._require_process("denoised")
        x0, cond = self.encoded(batch)  # (B, C_out, d, h, w), (B, C_cond, ...) | None
        t = process.timestep_at(fraction)
        timesteps = torch.full((x0.shape[0],), t, device=x0.device, dtype=process.timestep_dtype)
        noise = torch.randn(x0.shape, generator=generator, device=x0.device, dtype=torch.float32)
        x_t = process.add_noise(x0, noise, timesteps)
        x_in = model_input(x_t, cond)  # (B, C_out + C_cond, d, h, w)
        was_training = self.model.training
        self.model.eval()
        try:
            out = with_covariates(self.model, covariates)(x_in, timesteps=timesteps).float()
        finally:
            self.model.train(was_training)
        x0_hat = process.to_x0(out, x_t, t)
        if unweight and self.unweights_samples:
            x0_hat = self._unweighting()(x0_hat)
        return decode_volume(self.encoding, x0_hat, "image" if self.mode == "bravo" else "mask")

    def encoded(self, batch: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(x0, cond)`` of a data batch as this step's mode and recipe see it
        (:func:`voxdiff.diffusion.encode_batch`, which reads ``diffusion.mask_sdf_scale`` in seg mode only)."""
        return encode_batch(self.encoding, batch, self.mode, self.mask_sdf_scale)

    @property
    def mask_sdf_scale(self) -> float | None:
        """``diffusion.mask_sdf_scale`` of this step's recipe (None: the binary mask, or no diffusion process)."""
        return getattr(getattr(self.recipe, "diffusion", None), "mask_sdf_scale", None)

    @property
    def mask_weight(self) -> float:
        """``diffusion.mask_weight`` of this step's recipe (0: none, or no diffusion process)."""
        diffusion = getattr(self.recipe, "diffusion", None)
        return float(getattr(diffusion, "mask_weight", 0.0) or 0.0)

    @property
    def unweights_samples(self) -> bool:
        """Whether :meth:`generate` can undo a mask weight's bias: a mask model (``mode=seg``) trained with
        ``diffusion.mask_weight > 0`` on a weight-free encoding (the weight is then set by the target itself, so
        the model over-predicts the mask; :func:`voxdiff.diffusion.batch.unweighted_mask_prediction`)."""
        weight_free = not isinstance(self.encoding, LearnedEncoding)
        return mask_weight_to_undo(self.mode, getattr(self.recipe, "diffusion", None), weight_free) > 0

    def _unweighting(self) -> Callable[[torch.Tensor], torch.Tensor]:
        encoding, weight = self.encoding, self.mask_weight
        return lambda x0: unweighted_mask_prediction(x0, encoding, weight)

    def _require_process(self, what: str) -> Process:
        if self.process is None:
            raise RuntimeError(f"TrainStep.{what} needs a diffusion process (the seed recipe's loss has none)")
        return self.process

    # ------------------------------------------------------------------ the whole step
    def run(self, batch: Mapping[str, Any], probe: PhaseProbe | None = None) -> dict[str, torch.Tensor]:
        """One optimizer step on ``batch`` (see the module docstring); :meth:`configure_optimizer` first.

        Args:
            batch: as :meth:`loss` takes it, on the model's device.
            probe: told where each phase begins and ends (memory statistics).

        Returns:
            The loss function's statistics, plus ``grad_norm`` (the norm before clipping) when it was computed.

        Raises:
            NonFiniteLossError: the guard's check, when due after this step, found a non-finite step.
            CompileFailed: compiling the training step failed.
        """
        if self.optimizer is None:
            raise RuntimeError("TrainStep.run: call configure_optimizer() first")
        probe = probe or _NoProbe()
        step = self.steps_done
        probe.begin("forward")
        with self.precision.forward():
            loss, stats = self.loss(batch, step)
        probe.end("forward")
        self.zero_grad_before_backward()
        probe.begin("backward")
        with self.compile_errors():
            self.precision.backward(loss)
        del loss
        probe.end("backward")
        probe.begin("optimizer")
        self.precision.unscale(self.optimizer)
        norm = self.clip_and_check(step)
        self.precision.step(self.optimizer)
        if self.scheduler is not None:
            self.scheduler.step()
        self.steps_done += 1
        self.after_optimizer_step(step)
        probe.end("optimizer")
        return stats if norm is None else {**stats, "grad_norm": norm.detach()}


def batch_shapes(encoding: Encoding, volume_shape: tuple[int, int, int], batch_size: int,
                 covariate_dim: int = 0) -> dict[str, tuple[int, ...]]:
    """The tensors of a training batch as the data modules hand them to the step (both modes carry both; with
    covariates, ``covariates (B, K)`` too).

    Weight-free encodings (S2D, Haar, identity) get the volumes, ``image`` and ``mask`` ``(B, 1, D, H, W)``, and
    encode them inside the step; a learned encoding (VQ-VAE) trains on a latent cache, whose batches carry the
    latents ``image_z`` and ``mask_z`` ``(B, C, d, h, w)``.
    """
    covariates = {"covariates": (batch_size, covariate_dim)} if covariate_dim else {}
    if isinstance(encoding, LearnedEncoding):
        latent = encoding.encoded_shape((1, *volume_shape))
        return {"image_z": (batch_size, *latent), "mask_z": (batch_size, *latent), **covariates}
    return {"image": (batch_size, 1, *volume_shape), "mask": (batch_size, 1, *volume_shape), **covariates}
