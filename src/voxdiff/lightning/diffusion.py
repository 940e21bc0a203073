"""The Lightning system of a diffusion UNet: the training step's hooks, validation loss, samples, full resume.

``python train.py`` instantiates it from ``configs/system/diffusion.yaml`` (``_recursive_: false``) with the run
spec's system part (:class:`voxdiff.run.spec.SystemSpec`: the encoding, the UNet's arguments resolved for the
device, the step's recipe, sampling), which it builds from; the model, encoding, diffusion and mode configs arrive
as config nodes and are saved, as plain data, with ``save_hyperparameters`` (never modules). Rebuilt from a
checkpoint without a spec, it resolves its part from those hyper-parameters (:func:`voxdiff.run.spec.system_spec`,
the same checks).

The training step itself is :class:`voxdiff.step.TrainStep` (no Lightning in it), the same object the preflight
traces and the measure mode runs; the hooks below only hand it over to Lightning's loop::

    training_step               → step.loss (encode_batch → the process's loss, compiled with model.compile →
                                  guard record)
    optimizer_zero_grad         → step.zero_grad_before_backward (nothing: the system frees them after the step)
    backward                    → loss.backward() (compiler failures named: step.compile_errors)
    configure_gradient_clipping → step.clip_and_check (trainer.gradient_clip_val; gradient norm → guard record)
    optimizer_step              → Lightning's AdamW step, then step.after_optimizer_step (EMA, free gradients, end
                                  of the compile warm-up, the guard's check every system.guard.check_every_n_steps)
    on_save_checkpoint          → step.check_guard first: no checkpoint is written after a non-finite step
    configure_optimizers        → step.configure_optimizer (AdamW: fused on a GPU; warm-up/cosine)

No hook makes the host wait for the GPU in a steady-state step: the guard's record stays on the device, the loss
and the gradient norm are logged as device tensors (Lightning reads them at its logging steps only).

Lightning brings the autocast (``trainer.precision``, decided by :func:`voxdiff.step.decide_precision`) and the
backward. Checkpoints carry, besides Lightning's weights, optimizer, LR scheduler and loop state: the EMA weights
and the RNG states (torch CPU/CUDA, numpy, python) of every rank, so ``ckpt_path=...`` continues the same run.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from contextlib import suppress
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning as L
import torch
from lightning.pytorch.callbacks import TQDMProgressBar

from voxdiff.checkpoint import (
    GUIDE_GLOB,
    KINDS,
    checkpoint_kind,
    non_finite_tensor,
    weights_differences,
    without_weights_path,
)
from voxdiff.config import check_kind, plain
from voxdiff.data.covariates import CovariateEncoding
from voxdiff.diffusion import build_process, encoded_range
from voxdiff.encodings import LearnedEncoding
from voxdiff.errors import ConfigError
from voxdiff.evaluation.lesions import lesion_table
from voxdiff.files import load_file
from voxdiff.lightning.callbacks import GuideSnapshot, ProgressBar
from voxdiff.lightning.distributed import ema_checkpoint_state, shard_system
from voxdiff.lightning.optim import lightning_optimizers, unscale_before_clipping
from voxdiff.lightning.resume import check_weights_fit
from voxdiff.lightning.rng import gather_rng_states, restore_rng_states
from voxdiff.lightning.samples import save_samples
from voxdiff.models.sharding import is_sharded
from voxdiff.models.unet import build_unet_from_spec
from voxdiff.run.spec import system_spec
from voxdiff.step import (
    EMA,
    CompileSettings,
    NonFiniteLossError,
    TrainStep,
    accelerator_device,
    clip_settings,
)
from voxdiff.step.sampling import SamplerChoice, SamplingSettings, sampler_choice

if TYPE_CHECKING:
    from voxdiff.run.spec import SystemSpec

__all__ = ["DiffusionSystem", "NonFiniteLossError", "SamplingSettings"]

log = logging.getLogger(__name__)


#: what to do about a guide refused by :meth:`DiffusionSystem.load_guide`
GUIDE_FIX = f"use the guide snapshot of the same run (its checkpoints/{GUIDE_GLOB})"


class DiffusionSystem(L.LightningModule):
    """Trains a MONAI ``DiffusionModelUNet`` on encoded volumes (bravo: image | mask; seg: mask alone).

    Args:
        model: the ``model:`` config (``configs/model/*.yaml``; in/out channels follow from encoding and mode).
        encoding: the ``encoding:`` config (``_target_`` of a :class:`voxdiff.encodings.Encoding`).
        diffusion: the ``diffusion:`` config (:func:`voxdiff.diffusion.diffusion_settings`).
        mode: ``bravo`` (image conditioned on the mask) or ``seg`` (masks alone).
        optim: AdamW and schedule settings (:class:`voxdiff.step.OptimSettings`).
        ema: :class:`voxdiff.step.EMASettings`; ``false`` for no EMA (validation and samples then use the raw
            weights); None: the defaults.
        sampling: :class:`SamplingSettings`.
        val_timesteps: the validation loss of a batch is the mean over this many fixed, evenly spread timesteps
            (with fixed noise), so it is comparable from epoch to epoch.
        guard: ``system.guard`` (:class:`voxdiff.step.GuardSettings`): how often the non-finite guard is read.
        guidance: ``system.guidance`` (:class:`voxdiff.diffusion.GuidanceSettings`): condition dropout for
            classifier-free guidance; None: none.
        device_type: the device the system will run on (``cuda``, ``cpu``; default: ``cuda`` when one is
            present), which decides ``model.use_flash_attention=auto`` and ``model.compile=auto``. Not a
            hyper-parameter: the same checkpoint samples on another device.
        kind: ``system.kind``, what the run trains (:func:`voxdiff.config.run_kind`): must be :attr:`kind`, which
            is saved among the hyper-parameters (what :func:`voxdiff.checkpoint.checkpoint_kind` reads).
        spec: what to build, resolved from the same config by the run spec (:attr:`voxdiff.run.spec.RunSpec.system`,
            for ``device_type``); None: resolved here from the arguments above. Not a hyper-parameter.
        covariates: the covariate encoding the data module fitted on the training split
            (:meth:`voxdiff.data.covariates.CovariateEncoding.to_plain`; ``data.covariates``), saved as the
            hyper-parameter ``covariates`` so sampling encodes requested values the same way; it sets the UNet's
            covariate embedding (:mod:`voxdiff.models.covariates`). None: no covariates (and no such
            hyper-parameter: a run without covariates saves what it always saved).

    Config containers are converted to plain Python here; all of the above but ``device_type`` and ``spec`` is
    saved as hyper-parameters.
    """

    #: what a run of this system trains (``system.kind``, :data:`voxdiff.config.RUN_KINDS`)
    kind = "diffusion"

    def __init__(
        self,
        model: Mapping[str, Any],
        encoding: Mapping[str, Any],
        diffusion: Mapping[str, Any],
        mode: str = "bravo",
        optim: Mapping[str, Any] | None = None,
        ema: Mapping[str, Any] | bool | None = None,
        sampling: Mapping[str, Any] | None = None,
        val_timesteps: int = 4,
        guard: Mapping[str, Any] | None = None,
        guidance: Mapping[str, Any] | None = None,
        device_type: str | None = None,
        kind: str | None = None,
        spec: SystemSpec | None = None,
        covariates: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__()
        check_kind(type(self), kind)
        model, encoding, diffusion, optim, ema, sampling, guard, guidance, covariates = (
            plain(x) for x in (model, encoding, diffusion, optim, ema, sampling, guard, guidance, covariates)
        )
        self.save_hyperparameters(
            {"model": model, "encoding": encoding, "diffusion": diffusion, "mode": mode, "optim": optim,
             "ema": ema, "sampling": sampling, "val_timesteps": val_timesteps, "guard": guard, "guidance": guidance,
             "kind": self.kind, **({"covariates": covariates} if covariates else {})}
        )
        if spec is None:
            spec = system_spec(self.kind, self.hparams, device_type or accelerator_device("auto"))
        elif spec.kind != self.kind:
            raise ValueError(f"DiffusionSystem is built from a diffusion run's spec, not a {spec.kind} run's")
        self.system_spec = spec
        self.device_type = spec.device_type
        self.sampling, self.val_timesteps, self.mode = spec.sampling, spec.val_timesteps, spec.mode
        self.encoding = spec.encoding
        self.encoding.requires_grad_(False)
        # validated UNet arguments, in/out channels, the auto switches decided for this device; the covariate
        # embedding's width from the fitted encoding (the run spec's is the preflight's estimate)
        self.covariate_encoding = CovariateEncoding.from_plain(covariates) if covariates else None
        self.spec = replace(spec.unet, covariate_dim=self.covariate_encoding.width if covariates else 0)
        self.model = build_unet_from_spec(self.spec)
        recipe = replace(spec.recipe, clip=None)  # the Trainer's clipping is set at the start of fit
        self.process = build_process(recipe.diffusion, clip_range=encoded_range(self.encoding))
        compiled = (CompileSettings(self.spec.compile_mode, self.spec.compile_backend, model.get("compile", True),
                                    self.spec.channels_last)
                    if self.spec.compile else None)
        # the training step (a plain object, and so is its compiled forward: the checkpoint keys stay model.*)
        self.step = TrainStep(self.model, recipe, encoding=self.encoding, mode=self.mode, process=self.process,
                              compile=compiled)
        self._val_cache: list[dict[str, Any]] = []
        self._last_sampled_step: int | None = None
        self.sampling_now = False  # True while write_samples samples, and after it raised (FailurePoint)
        self._pending_rng_states: list[dict[str, Any]] | None = None

    @property
    def ema(self) -> EMA | None:
        """The EMA of the weights (None with ``system.ema: false``)."""
        return self.step.ema

    # ------------------------------------------------------------------ training: hooks of the TrainStep
    def train(self, mode: bool = True) -> DiffusionSystem:
        super().train(mode)
        self.encoding.eval()  # a learned encoding is frozen (no batch statistics, no codebook updates)
        return self

    def configure_model(self) -> None:
        """``trainer=fsdp`` (a device mesh): shard the UNet per resnet/attention block, the EMA with it
        (:func:`voxdiff.lightning.distributed.shard_system`); other strategies: nothing."""
        if self.device_mesh is not None:
            shard_system(self, self.device_mesh)

    def on_fit_start(self) -> None:
        self.step.to(self.device)
        self.step.clip = clip_settings(self.trainer.gradient_clip_val, self.trainer.gradient_clip_algorithm)
        # fp16 with a GradScaler: inf gradients are expected and skipped by the scaler, not a reason to stop
        self.step.loss_scaled = getattr(self.trainer.precision_plugin, "scaler", None) is not None
        if self.step.guard is not None:  # a non-finite value on any rank stops all ranks
            self.step.guard.any_rank = lambda bad: self.trainer.strategy.reduce_boolean_decision(bad, all=False)

    def training_step(self, batch: Mapping[str, Any], batch_idx: int) -> torch.Tensor:
        if self.step.compiled is not None and self.step.compiled.seconds is None:
            self._progress_note(f"compiling the training step ({self.step.compiled.settings.describe()})")
        loss, stats = self.step.loss(batch, self.global_step)
        b = stats["timesteps"].shape[0]
        # device tensors for the logger, which reads them at its logging steps only
        self.log("train/loss", loss.detach(), on_step=True, on_epoch=False, batch_size=b)
        if self.process.weighted:  # the plain MSE beside the weighted loss
            self.log("train/mse", stats["mse"], on_step=True, on_epoch=False, batch_size=b)
        if self.global_step == 0 or (self.global_step + 1) % self.trainer.log_every_n_steps == 0:
            ProgressBar.show(self.trainer, "loss", loss.item())  # the bar's number: one sync, at logging steps only
        return loss

    def _progress_note(self, text: str) -> None:
        """Show ``text`` after the training progress bar (TQDM), e.g. during the compile warm-up."""
        bar = self.trainer.progress_bar_callback
        if isinstance(bar, TQDMProgressBar):
            with suppress(TypeError):  # Lightning raises it when there is no bar (yet)
                bar.train_progress_bar.set_postfix_str(text)

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: torch.optim.Optimizer) -> None:
        self.step.zero_grad_before_backward()

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        with self.step.compile_errors():  # the compiled backward graph is built here, on the first step
            super().backward(loss, *args, **kwargs)

    def configure_gradient_clipping(self, optimizer: torch.optim.Optimizer, gradient_clip_val: float | None = None,
                                    gradient_clip_algorithm: str | None = None) -> None:
        """Clip as the Trainer says (``step.clip``, set at fit start); the guard records a non-finite norm. Under fp16
        the gradients are unscaled first (:func:`~voxdiff.lightning.optim.unscale_before_clipping`)."""
        if self.step.clip is not None:
            unscale_before_clipping(self.trainer, optimizer)
        norm = self.step.clip_and_check(self.global_step)
        if norm is not None:
            self.log("train/grad_norm", norm.detach(), on_step=True, on_epoch=False, batch_size=1)

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        step = self.global_step  # before Lightning counts this optimizer step
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        warmup = self.step.after_optimizer_step(step)
        if warmup is not None:  # the compile warm-up, once: to the loggers at this step, and on the bar
            for logger in self.loggers:
                logger.log_metrics({"train/compile_s": warmup}, step=self.global_step)
            ProgressBar.show(self.trainer, "compile_s", round(warmup, 1))

    def configure_optimizers(self) -> dict[str, Any]:
        return lightning_optimizers(*self.step.configure_optimizer(self.trainer.estimated_stepping_batches))

    # ------------------------------------------------------------------ validation
    def _generator(self, offset: int) -> torch.Generator:
        g = torch.Generator(device=self.device)
        g.manual_seed(self.sampling.seed * 1_000_003 + self.global_rank * 100_003 + offset)
        return g

    def validation_step(self, batch: Mapping[str, Any], batch_idx: int) -> torch.Tensor:
        # a fixed generator per batch: comparable across epochs, and the global RNG (data order, training noise)
        # is not touched, so a resumed run draws what an uninterrupted one would
        loss, b = self.step.validation_loss(batch, self.val_timesteps, self._generator(batch_idx))
        self.log("val/loss", loss, on_step=False, on_epoch=True, prog_bar=True, batch_size=b, sync_dist=True)
        self._cache_for_sampling(batch)
        return loss

    def _cache_for_sampling(self, batch: Mapping[str, Any]) -> None:
        if self.trainer.sanity_checking or "mask" not in batch:
            return
        if len(self._val_cache) >= self.sampling.num_masks:
            return
        n = min(batch["mask"].shape[0], self.sampling.num_masks - len(self._val_cache))
        subjects = batch.get("subject", [f"val{len(self._val_cache) + i}" for i in range(n)])
        affines = batch.get("affine")
        for i in range(n):
            self._val_cache.append({
                "mask": batch["mask"][i : i + 1].detach().cpu(),
                "image": batch["image"][i : i + 1].detach().cpu() if "image" in batch else None,
                "affine": torch.eye(4, dtype=torch.float64) if affines is None else affines[i].detach().cpu().double(),
                "subject": str(subjects[i]),
                "covariates": batch["covariates"][i : i + 1].detach().cpu() if "covariates" in batch else None,
            })

    def on_validation_start(self) -> None:
        if self.trainer.state.fn == "fit" and not self.trainer.sanity_checking:
            self.step.check_guard(" (checked before validation)")  # never sample from non-finite weights

    def on_validation_epoch_start(self) -> None:
        self._val_cache = []

    def on_validation_epoch_end(self) -> None:
        every = self.sampling.every_n_epochs
        if self.trainer.sanity_checking or not every or (self.current_epoch + 1) % every:
            return
        self.write_samples(f"epoch{self.current_epoch:04d}_step{self.global_step:07d}")

    def on_train_end(self) -> None:
        self.step.check_guard(" (checked at the end of training)")
        if self.sampling.final and self._last_sampled_step != self.global_step and self.global_step > 0:
            self.write_samples(f"final_step{self.global_step:07d}")

    # ------------------------------------------------------------------ sampling
    @torch.no_grad()
    def generate(
        self,
        mask: torch.Tensor,
        num_inference_steps: int | None = None,
        generator: torch.Generator | None = None,
        use_ema: bool = True,
        eta: float | None = None,
        guidance_scale: float | None = None,
        batch_size: int | None = None,
        covariates: torch.Tensor | None = None,
        guide: torch.nn.Module | None = None,
        autoguide_scale: float = 1.0,
        guidance_interval: Any = None,
        unweight: bool = True,
    ) -> torch.Tensor:
        """Generate volumes (DDIM, or Euler for rectified flow) from the EMA weights (by default).

        Args:
            mask: ``(B, 1, D, H, W)`` masks in {0, 1}: the condition in bravo mode; in seg mode only its shape is
                used (B masks of that size are generated).
            num_inference_steps: sampling steps (default ``sampling.num_inference_steps``, else the diffusion's).
            generator: generator of the initial noise (on this module's device).
            use_ema: sample with the EMA weights (swapped in and restored).
            eta: DDIM stochasticity (default: the diffusion config's).
            guidance_scale: classifier-free guidance (default ``sampling.guidance_scale``; 1: none).
            batch_size: masks sampled at once (default ``sampling.batch_size``).
            covariates: ``(B, K)`` covariate vectors (:meth:`CovariateEncoding.vector`), one per mask; needed by
                a model trained with covariates, refused by one without.
            guide, autoguide_scale: autoguidance by ``guide``, the same UNet less trained (the run's guide
                snapshot, with its EMA weights in place); 1 or no guide: none (:meth:`TrainStep.generate`).
            guidance_interval: ``(lo, hi)`` fractions of the schedule (``t / T``) whose steps either guidance runs
                at (default ``sampling.guidance_interval``; ``(0, 1)``: every step).
            unweight: undo a mask model's ``diffusion.mask_weight`` (:attr:`TrainStep.unweights_samples`); False:
                draw what the weighted loss's minimiser draws, lesion outcomes counted ``1 + w`` times.

        Returns:
            ``(B, 1, D, H, W)`` float32 on this module's device: images in [0, 1] (bravo) or masks in {0, 1} (seg).
        """
        mask = mask.to(self.device, torch.float32)
        if mask.dim() != 5 or mask.shape[1] != 1:
            raise ValueError(f"mask must be (B, 1, D, H, W), got {tuple(mask.shape)}")
        if (covariates is None) != (self.covariate_encoding is None):
            raise ValueError("a model trained with covariates samples with one (B, K) vector per mask, and one "
                             f"without takes none (this one: {self.covariate_encoding and self.covariate_encoding.names})")
        if covariates is not None:
            covariates = covariates.to(self.device, torch.float32)
            if covariates.shape != (mask.shape[0], self.covariate_encoding.width):
                raise ValueError(f"covariates must be ({mask.shape[0]}, {self.covariate_encoding.width}), got "
                                 f"{tuple(covariates.shape)}")
        self.step.to(self.device)
        scale = self.sampling.guidance_scale if guidance_scale is None else guidance_scale
        interval = self.sampling.guidance_interval if guidance_interval is None else guidance_interval
        return self.step.generate(mask, self.spec.out_channels, num_inference_steps or self.sampling.num_inference_steps,
                                  generator=generator, eta=eta, use_ema=use_ema, guidance_scale=float(scale),
                                  batch_size=batch_size or self.sampling.batch_size, covariates=covariates,
                                  guide=guide, autoguide_scale=autoguide_scale,
                                  guidance_interval=tuple(interval), unweight=unweight)

    def sampler(self, num_inference_steps: Any = None, eta: Any = None, guidance_scale: Any = None,
                autoguide_scale: Any = None, guidance_interval: Any = None, unweight: Any = None) -> SamplerChoice:
        """What :meth:`generate` runs with a command's own arguments (None: as trained; ``unweight`` None: true);
        refuses those this model cannot take (:func:`voxdiff.step.sampling.sampler_choice`)."""
        guidance = self.step.recipe.guidance
        return sampler_choice(self.process.settings, self.sampling, self.mode,
                              guidance.drop_prob if guidance is not None else 0.0,
                              num_inference_steps=num_inference_steps, eta=eta, guidance_scale=guidance_scale,
                              autoguide_scale=autoguide_scale, guidance_interval=guidance_interval,
                              unweight=unweight, weight_free=not isinstance(self.encoding, LearnedEncoding))

    def _fill_val_cache(self) -> None:
        """Cache validation masks straight from the data module when no validation has run yet."""
        datamodule = getattr(self.trainer, "datamodule", None)
        if self._val_cache or datamodule is None or not hasattr(datamodule, "val_dataloader"):
            return
        with torch.random.fork_rng(devices=[]):  # a DataLoader iterator draws a seed from the global RNG
            for batch in datamodule.val_dataloader():
                self._cache_for_sampling(batch)
                if len(self._val_cache) >= self.sampling.num_masks:
                    break

    def sampling_guide(self) -> tuple[torch.nn.Module | None, float]:
        """``(guide, scale)`` of the samples drawn in training: the run's own autoguidance
        (``system.sampling.autoguide_scale``, the default of its ``sample.py`` and ``evaluate.py``) once its guide
        snapshot is written (:class:`~voxdiff.lightning.callbacks.GuideSnapshot`, ``callbacks.guide.step``): the
        snapshot's UNet with its EMA weights written in (:meth:`load_guide`, as ``sample.py`` loads it; the raw
        weights without an EMA), frozen, on this module's device, where the preflight's sampling phase counts it.
        ``(None, 1.0)``: the scale is 1, the run takes no snapshot or has not reached it, or the model is sharded
        (FSDP; the log says why)."""
        scale = float(self.sampling.autoguide_scale)
        snapshot = next((c for c in getattr(self.trainer, "callbacks", []) if isinstance(c, GuideSnapshot)), None)
        if scale == 1.0 or snapshot is None or snapshot.path is None:
            return None, 1.0
        if self.global_step < snapshot.step or not snapshot.path.is_file():
            log.info("samples at step %d drawn without autoguidance: its guide snapshot is taken after step %d",
                     self.global_step, snapshot.step)
            return None, 1.0
        if is_sharded(self.model):
            log.warning("samples drawn without autoguidance: the model is sharded (FSDP) and its guide is not; "
                        "sample.py autoguides with %s", snapshot.path)
            return None, 1.0
        guide = self.load_guide(snapshot.path, use_ema=self.ema is not None).to(self.device)
        log.info("samples autoguided at scale %g by %s", scale, snapshot.path)
        return guide, scale

    def load_guide(self, path: str | Path, use_ema: bool, key: str = "autoguide_ckpt",
                   fix: str = GUIDE_FIX) -> torch.nn.Module:
        """The guide of autoguidance from the checkpoint ``path`` (a run's guide snapshot): this system's UNet, built
        from its spec on the meta device (no initialisation, so no draw from the global RNG and no host copy), with
        the checkpoint's weights made its own, its EMA weights written in when ``use_ema`` and it has them; frozen, in
        eval mode, on the CPU, in the spec's memory layout. The file is mapped, not read: only the weights are paged
        in, not its optimizer state. Training's samples (:meth:`sampling_guide`) and ``sample.py`` / ``evaluate.py``
        (:func:`voxdiff.cli.sample.checked`) load a guide through this one path.

        Raises:
            ConfigError: naming ``key``: the file is unreadable or not a diffusion checkpoint, a weight of it is not
                finite, or it is another model: another ``mode`` or encoding, or weights of other names or shapes
                (:func:`~voxdiff.checkpoint.weights_differences`).
        """
        state = load_file(path, key, fix, mmap=True)
        found = checkpoint_kind(state)
        if found != "diffusion":
            raise ConfigError(key, str(path), f"is {KINDS[found]}; a guide is {KINDS['diffusion']}", fix)
        bad = non_finite_tensor(state)
        if bad is not None:
            raise ConfigError(key, str(path), f"its weight {bad} holds NaN or infinite values", fix)
        recorded = state["hyper_parameters"]
        other = [part for part in ("mode", "encoding")
                 if without_weights_path(recorded.get(part)) != without_weights_path(self.hparams.get(part))]
        if other:
            raise ConfigError(key, str(path), f"is another model: it records {' and '.join(other)} "
                              f"{' and '.join(str(plain(recorded.get(p))) for p in other)}, where this one has "
                              f"{' and '.join(str(plain(self.hparams.get(p))) for p in other)} (a guide is the same "
                              "network, less trained)", fix)
        with torch.device("meta"):
            guide = build_unet_from_spec(self.spec)
        expected = {f"model.{k}": v for k, v in guide.state_dict().items()}
        ours = {k: v for k, v in state["state_dict"].items() if k.startswith("model.")}
        differences = weights_differences(expected, {"state_dict": ours, "ema": state.get("ema")})
        if differences:
            raise ConfigError(key, str(path), f"has other weights than this model ({differences}): a guide is the "
                              "same network, less trained", fix)
        weights = {k[len("model."):]: v for k, v in ours.items()}
        if use_ema and "ema" in state:
            weights.update(state["ema"]["shadow"])
        guide.load_state_dict(weights, assign=True)
        if self.spec.channels_last:  # the loaded weights are contiguous; the model's layout, as the spec asks
            guide.to(memory_format=torch.channels_last_3d)
        return guide.requires_grad_(False).eval()

    def write_samples(self, tag: str) -> list[Path]:
        """Sample from the cached validation masks (EMA weights, DDIM; autoguided as the run's commands sample once
        its guide snapshot exists: :meth:`sampling_guide`), save NIfTI + montage, log the montage.
        Rank 0 writes; under FSDP every rank runs the sharded UNet with it (each forward gathers from all ranks)."""
        if not self.sampling.num_masks or not (self.trainer.is_global_zero or is_sharded(self.model)):
            return []
        self._fill_val_cache()
        if not self._val_cache:
            log.warning("no validation masks to sample from: no samples written")
            return []

        out_dir = Path(self.trainer.default_root_dir) / "samples"
        masks = torch.cat([c["mask"] for c in self._val_cache])
        images = None if self._val_cache[0]["image"] is None else torch.cat([c["image"] for c in self._val_cache])
        covariates = (torch.cat([c["covariates"] for c in self._val_cache])
                      if self._val_cache[0]["covariates"] is not None else None)  # (B, K): the subjects' own
        # the phase a failure is reported in (voxdiff.lightning.callbacks.FailurePoint, called after the exception
        # has left this frame): left True when sampling raises
        self.sampling_now = True
        guide, autoguide = self.sampling_guide()
        with self.trainer.precision_plugin.forward_context():
            generated = self.generate(masks, generator=self._generator(1_000_000), covariates=covariates,
                                      guide=guide, autoguide_scale=autoguide).cpu()
        del guide  # off the device before training goes on
        self.sampling_now = False
        if not self.trainer.is_global_zero:
            return []
        values = None if covariates is None else [self.covariate_encoding.values(v) for v in covariates]
        pngs = save_samples(out_dir, tag, self.mode, generated, masks, images,
                            [c["affine"] for c in self._val_cache], [c["subject"] for c in self._val_cache],
                            covariates=values)  # with covariates, the values each sample was drawn at beside it
        self._last_sampled_step = self.global_step
        log.info("samples written to %s", out_dir)
        if self.mode == "seg":
            self._log_lesions(generated, masks.cpu())
        for logger in self.loggers:
            if hasattr(logger, "log_image"):
                logger.log_image(key="samples", images=[str(p) for p in pngs], step=self.global_step,
                                 caption=[p.stem for p in pngs])
        return pngs

    def _log_lesions(self, generated: torch.Tensor, masks: torch.Tensor) -> None:
        """A mask model's samples ``(B, 1, D, H, W)`` against the validation masks ``(B, 1, D, H, W)`` they stand
        beside: lesions and lesion voxels a mask of each (:func:`voxdiff.evaluation.lesions.lesion_table`), logged as
        ``samples/...`` and printed, so that a run drawing empty masks, or far too much lesion, shows it while it
        trains (``evaluate.py`` measures it in full)."""
        drawn, shown = lesion_table(generated), lesion_table(masks)
        metrics = {"samples/lesions_per_mask": float(drawn.lesions.mean()),
                   "samples/lesion_voxels_per_mask": float(drawn.voxels.mean()),
                   "samples/real_lesions_per_mask": float(shown.lesions.mean()),
                   "samples/real_lesion_voxels_per_mask": float(shown.voxels.mean())}
        for logger in self.loggers:
            logger.log_metrics(metrics, step=self.global_step)
        log.info("samples at step %d: %.2f lesions of %.1f voxels a mask (the validation masks: %.2f of %.1f)",
                 self.global_step, *metrics.values())

    # ------------------------------------------------------------------ checkpoints
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # before anything is written: a non-finite step since the last check stops the run here, and the
        # checkpoint on disk stays the last good one
        self.step.check_guard(" (checked before writing a checkpoint)")
        if self.ema is not None:  # full tensors (gathered from the shards under FSDP)
            checkpoint["ema"] = ema_checkpoint_state(self.ema, self.model)
        checkpoint["rng_states"] = gather_rng_states()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        check_weights_fit(self, checkpoint)  # resuming: the keys that differ, not load_state_dict's pages
        if self.ema is None:
            if "ema" in checkpoint:
                log.warning("system.ema=false: the EMA weights in the checkpoint are not used")
        elif "ema" in checkpoint:
            self.ema.load_state_dict(checkpoint["ema"])
        else:  # e.g. a weights-only checkpoint: the average starts at the loaded weights
            log.warning("the checkpoint has no EMA state: the EMA starts from the loaded weights")
            weights = {k[len("model."):]: v for k, v in checkpoint["state_dict"].items() if k.startswith("model.")}
            self.ema.load_state_dict({"shadow": weights, "num_updates": 0})
        # the RNG only when resuming a fit (load_from_checkpoint for sampling leaves the caller's RNG alone), and
        # only at on_train_start: after the sanity-check validation, whose data loader draws from the global RNG
        if self._trainer is not None and "rng_states" in checkpoint:
            self._pending_rng_states = checkpoint["rng_states"]

    def on_train_start(self) -> None:
        if self._pending_rng_states is not None:
            restore_rng_states(self._pending_rng_states, self.trainer.global_rank)
            self._pending_rng_states = None
