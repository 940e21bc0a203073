"""Stage 1 of latent diffusion: MONAI's 3D VQ-VAE as a Lightning system.

``python train.py experiment=vqvae_4x`` (or ``vqvae_8x``, ``vqvae_demo``) instantiates :class:`VQVAESystem` from
``configs/system/vqvae.yaml`` and trains it through the same ``train.py``, Trainer, checkpoint IO, logger and resume
path as the diffusion systems. Its checkpoint is what ``encoding.checkpoint`` and ``cache_latents.py`` read
(:func:`voxdiff.encodings.vqvae.read_stage1_checkpoint`).

One VQ-VAE serves both modalities: it is single-channel in and out, and every batch trains it on the images and
the masks together (stacked along the batch axis), so one codebook encodes both. The loss is the reconstruction
loss (MSE or L1) plus the VQ loss (commitment term; the codebook itself follows an EMA of its assigned encoder
outputs, van den Oord et al. 2017).

Each validation epoch logs PSNR and SSIM of the image reconstructions (MONAI's ``PSNRMetric``/``SSIMMetric`` on
reconstructions clamped to the data range [0, 1]), PSNR and Dice of the mask reconstructions, the codebook
perplexity, saves a montage ``<run dir>/montages/vqvae_epoch<NNNN>.png`` (original | reconstruction, image and
mask) and measures the latent scale: ``latent_scale = 1 / std`` of the quantised image latents over the
validation set. The scale is a buffer, so it is saved with the weights and becomes part of the checkpoint's
identity; :class:`~voxdiff.encodings.VQVAELatent` multiplies latents by it and divides it out before decoding.
A checkpoint carries the scale of the last validation epoch before it was written (any fixed scale is exact for
encode/decode, which use the same number; it only sets how close to unit variance the diffusion's inputs are —
``cache_latents.py`` records the std it got). With validation turned off it stays 1 (no scaling).

The codebook is started from encoder outputs of the first training batch and codes that fall out of use are
restarted at encoder outputs (``system.codebook``): MONAI's EMA codebook starts at N(0, 1) vectors far from the
encoder's outputs and, without this, collapses to one or two codes. Both are broadcast from rank 0, and MONAI
all-reduces the EMA statistics, so the codebooks of DDP ranks stay identical.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from einops import rearrange

from voxdiff.config import check_kind, plain
from voxdiff.encodings.vqvae import SCALE_KEY, build_vqvae
from voxdiff.lightning.optim import configure_adamw, unscale_before_clipping
from voxdiff.lightning.resume import check_weights_fit
from voxdiff.lightning.rng import gather_rng_states, restore_rng_states
from voxdiff.run.spec import MODALITIES, SystemSpec, check_montage_every, system_spec
from voxdiff.step import PhaseProbe
from voxdiff.step.optim import clip_gradients
from voxdiff.step.recipe import clip_settings
from voxdiff.viz import save_montage

log = logging.getLogger(__name__)

__all__ = ["MODALITIES", "VQVAESystem"]


@contextmanager
def _phase(probe: PhaseProbe | None, name: str) -> Iterator[None]:
    """Tell ``probe`` (if any) where the phase ``name`` begins and ends."""
    if probe is not None:
        probe.begin(name)
    yield
    if probe is not None:
        probe.end(name)


class VQVAESystem(L.LightningModule):
    """Trains one single-channel 3D VQ-VAE on the images and masks of a :class:`voxdiff.data.VolumeDataModule`.

    Batches are ``{"image": (B, 1, D, H, W), "mask": (B, 1, D, H, W), ...}``; every modality in ``modalities``
    is stacked into one ``(B·M, 1, D, H, W)`` batch of the autoencoder.

    Args:
        vqvae: the architecture, :func:`voxdiff.encodings.vqvae.vqvae_spec`'s arguments (``factor``,
            ``latent_channels``, ``channels``, ``num_res_layers``, ``num_res_channels``, ``num_embeddings``,
            ``commitment_cost``, ``decay``, ``use_checkpoint``).
        optim: AdamW and its warm-up/cosine schedule, the same settings as the diffusion system's
            (:class:`voxdiff.step.optim.OptimSettings`: ``lr``, ``betas``, ``warmup_steps``, ...).
        loss: ``reconstruction`` (``mse``, the default, or ``l1``) and ``quantization_weight`` (weight of the VQ
            loss). On the phantom, L1 often stalls at the blurred mean head for the first hundreds of steps (its
            optimum on a mostly-zero volume is the median, zero), where MSE does not.
        modalities: batch keys the autoencoder is trained on (default both: ``[image, mask]``).
        volume_shape: ``(D, H, W)`` of the training volumes (recorded in the checkpoint; checked against batches).
        montage_every_n_epochs: save a reconstruction montage every this many validation epochs (0: never).
        codebook: ``init_from_data`` (start the codebook from encoder outputs of the first training batch) and
            ``dead_code_fraction`` (a code whose EMA usage falls below this fraction of uniform usage is restarted
            at an encoder output of the current batch; 0 turns restarts off). MONAI's EMA codebook starts at
            N(0, 1) vectors far from the encoder's outputs and collapses to one or two codes without these.
        kind: ``system.kind``, what the run trains (:func:`voxdiff.config.run_kind`): must be :attr:`kind`, which
            is saved among the hyper-parameters (what :func:`voxdiff.checkpoint.checkpoint_kind` reads).
        spec: the run spec's system part (:attr:`voxdiff.run.spec.RunSpec.system`, its
            :class:`~voxdiff.run.spec.Stage1Settings` validated with the rest of the config); None: the
            arguments above are validated here the same way. Not a hyper-parameter.
    """

    #: what a run of this system trains (``system.kind``, :data:`voxdiff.config.RUN_KINDS`): a learned encoding's
    #: stage 1
    kind = "stage1"

    def __init__(
        self,
        vqvae: Mapping[str, Any],
        optim: Mapping[str, Any] | None = None,
        loss: Mapping[str, Any] | None = None,
        modalities: Sequence[str] = MODALITIES,
        volume_shape: Sequence[int] | None = None,
        montage_every_n_epochs: int = 1,
        codebook: Mapping[str, Any] | None = None,
        kind: str | None = None,
        spec: SystemSpec | None = None,
    ) -> None:
        super().__init__()
        check_kind(type(self), kind)
        if spec is None:  # resolved here from the arguments, by the run spec's checks
            given = {"vqvae": vqvae, "optim": optim, "loss": loss, "modalities": modalities,
                     "volume_shape": volume_shape, "codebook": codebook}
            spec = system_spec(self.kind, {k: v for k, v in given.items() if v is not None}, "cpu")
        elif spec.kind != self.kind:
            raise ValueError(f"VQVAESystem is built from a stage-1 run's spec, not a {spec.kind} run's")
        settings = spec.stage1
        self.optim_settings = settings.optim
        optim = plain(optim) or {}
        self.save_hyperparameters(
            {
                "vqvae": settings.vqvae.as_dict(),
                "optim": optim,
                "loss": dict(settings.loss),
                "modalities": list(settings.modalities),
                "volume_shape": None if settings.volume_shape is None else list(settings.volume_shape),
                "montage_every_n_epochs": check_montage_every(montage_every_n_epochs),
                "codebook": dict(settings.codebook),
                "kind": self.kind,
            }
        )
        self.spec = settings.vqvae
        self.vqvae = build_vqvae(settings.vqvae)
        # 1/std of the quantised image latents, measured each validation epoch (see the module docstring)
        self.register_buffer(SCALE_KEY, torch.tensor(1.0, dtype=torch.float32))
        # whether the codebook was started from data (saved, so a resumed run does not start it again)
        self.register_buffer("codebook_initialised", torch.tensor(False))
        self._metrics = None
        self._scale_sums: torch.Tensor | None = None
        self._montage: dict[str, Any] | None = None

    # ---- the autoencoder ----------------------------------------------------------------------------------
    def forward(
        self, x: torch.Tensor, probe: PhaseProbe | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x (N, 1, D, H, W)`` → (reconstruction ``(N, 1, D, H, W)``, encoder outputs and quantised latents
        ``(N, latent_channels, D/f, H/f, W/f)`` each, VQ loss (scalar)).

        ``probe`` (the preflight's memory probe, :class:`voxdiff.step.PhaseProbe`) is told where the ``encoder``,
        ``quantizer`` and ``decoder`` phases begin and end."""
        with _phase(probe, "encoder"):
            z = self.vqvae.encode(x)
        if self.training and self.hparams.codebook["init_from_data"] and not bool(self.codebook_initialised):
            self._init_codebook(z)
        with _phase(probe, "quantizer"):
            q, vq_loss = self.vqvae.quantize(z)
        with _phase(probe, "decoder"):
            recon = self.vqvae.decode(q)
        return recon, z, q, vq_loss

    # ---- the codebook -------------------------------------------------------------------------------------
    def _sample_vectors(self, z: torch.Tensor, n: int) -> torch.Tensor:
        """``n`` encoder output vectors ``(n, latent_channels)`` drawn from ``z``, the same on every rank."""
        flat = rearrange(z.detach().float(), "n k d h w -> (n d h w) k")
        idx = torch.randint(len(flat), (n,), device=flat.device)
        picked = flat[idx] + 1e-3 * flat.std() * torch.randn_like(flat[idx])
        return self.trainer.strategy.broadcast(picked, src=0) if self._trainer is not None else picked

    @torch.no_grad()
    def _init_codebook(self, z: torch.Tensor) -> None:
        qz = self.vqvae.quantizer.quantizer
        codes = self._sample_vectors(z, qz.num_embeddings)
        qz.embedding.weight.data.copy_(codes)
        qz.ema_w.data.copy_(codes)  # with a usage of 1 each: unused codes keep their place instead of drifting
        qz.ema_cluster_size.data.fill_(1.0)
        self.codebook_initialised.fill_(True)

    @torch.no_grad()
    def _restart_dead_codes(self, z: torch.Tensor) -> int:
        """Move codes that (almost) no latent uses to encoder outputs of this batch; returns how many moved."""
        fraction = self.hparams.codebook["dead_code_fraction"]
        if not fraction:
            return 0
        qz = self.vqvae.quantizer.quantizer
        usage = qz.ema_cluster_size
        uniform = usage.sum() / qz.num_embeddings
        dead = (usage < fraction * uniform).nonzero().flatten()
        if len(dead) == 0:
            return 0
        codes = self._sample_vectors(z, len(dead))
        qz.ema_cluster_size.data[dead] = uniform
        qz.ema_w.data[dead] = codes * uniform
        qz.embedding.weight.data[dead] = codes
        return len(dead)

    def _stack(self, batch: Mapping[str, Any]) -> torch.Tensor:
        """The modalities of a batch stacked along the batch axis: ``(M·B, 1, D, H, W)``, modality-major."""
        missing = [m for m in self.hparams.modalities if m not in batch]
        if missing:
            raise KeyError(f"VQVAESystem needs batch keys {self.hparams.modalities}; this batch lacks {missing} "
                           f"(it has {sorted(batch)})")
        vols = [batch[m] for m in self.hparams.modalities]
        for m, v in zip(self.hparams.modalities, vols):
            if v.dim() != 5 or v.shape[1] != 1:
                raise ValueError(f"batch[{m!r}] must be (B, 1, D, H, W), got {tuple(v.shape)}")
        return rearrange(torch.stack(vols), "m b 1 d h w -> (m b) 1 d h w")

    def _losses(self, x: torch.Tensor, probe: PhaseProbe | None = None) -> dict[str, torch.Tensor]:
        recon, z, q, vq_loss = self(x, probe=probe)
        with _phase(probe, "loss"):
            fn = F.l1_loss if self.hparams.loss["reconstruction"] == "l1" else F.mse_loss
            recon_loss = fn(recon.float(), x.float())
            loss = recon_loss + self.hparams.loss["quantization_weight"] * vq_loss.float()
        return {"loss": loss, "recon_loss": recon_loss, "vq_loss": vq_loss.float(), "recon": recon, "z": z, "q": q}

    # ---- training ---------------------------------------------------------------------------------------------
    def training_losses(self, batch: Mapping[str, Any], probe: PhaseProbe | None = None) -> dict[str, torch.Tensor]:
        """The forward of a training step: the modalities stacked, autoencoded, the losses. ``training_step`` and the
        preflight's trace of stage 1 (:mod:`voxdiff.preflight.stage1`) both call it.

        Returns:
            ``loss`` (with grad), ``recon_loss``, ``vq_loss`` (scalars), ``recon`` ``(M·B, 1, D, H, W)``, ``z`` and
            ``q`` ``(M·B, latent_channels, d, h, w)``.
        """
        return self._losses(self._stack(batch), probe)

    def training_step(self, batch: Mapping[str, Any], batch_idx: int) -> torch.Tensor:
        out = self.training_losses(batch)
        bs = batch[self.hparams.modalities[0]].shape[0]
        for key in ("loss", "recon_loss", "vq_loss"):
            self.log(f"train/{key}", out[key], prog_bar=key == "loss", batch_size=bs)
        self.log("train/perplexity", self.vqvae.quantizer.perplexity.float(), batch_size=bs)
        self.log("train/dead_codes", float(self._restart_dead_codes(out["z"])), batch_size=bs)
        return out["loss"]

    def configure_gradient_clipping(self, optimizer: torch.optim.Optimizer, gradient_clip_val: float | None = None,
                                    gradient_clip_algorithm: str | None = None) -> None:
        """Clip as the Trainer says (``trainer.gradient_clip_val``), through :func:`voxdiff.step.optim.
        clip_gradients`: Lightning's own clipping refuses fused AdamW, the default on a GPU."""
        clip = clip_settings(gradient_clip_val, gradient_clip_algorithm)
        if clip is None:
            return
        unscale_before_clipping(self.trainer, optimizer)
        norm = clip_gradients([p for group in optimizer.param_groups for p in group["params"]], clip.value,
                              clip.algorithm)
        self.log("train/grad_norm", norm.detach(), on_step=True, on_epoch=False, batch_size=1)

    def configure_optimizers(self) -> dict[str, Any]:
        # the codebook is EMA-updated, not optimised (build_optimizer skips parameters without requires_grad)
        return configure_adamw(self.vqvae.parameters(), self.optim_settings, self.trainer.estimated_stepping_batches)

    # ---- validation ---------------------------------------------------------------------------------------------
    def _metric_objects(self):
        if self._metrics is None:
            from monai.metrics import PSNRMetric, SSIMMetric

            smallest = min(self.hparams.volume_shape or (11,))
            win = min(11, smallest - (1 - smallest % 2))  # odd and no larger than the volume
            self._metrics = (PSNRMetric(max_val=1.0, reduction="mean"),
                             SSIMMetric(spatial_dims=3, data_range=1.0, win_size=max(win, 3), reduction="mean"))
        return self._metrics

    def on_validation_epoch_start(self) -> None:
        self._scale_sums = torch.zeros(3, dtype=torch.float64, device=self.device)  # n, Σq, Σq²
        self._montage = None

    def validation_step(self, batch: Mapping[str, Any], batch_idx: int) -> None:
        x = self._stack(batch)
        out = self._losses(x)
        mods = self.hparams.modalities
        bs = batch[mods[0]].shape[0]
        for key in ("loss", "recon_loss", "vq_loss"):
            self.log(f"val/{key}", out[key], prog_bar=key == "loss", batch_size=bs, sync_dist=True)
        recon = rearrange(out["recon"].float().clamp(0.0, 1.0), "(m b) 1 d h w -> m b 1 d h w", m=len(mods))
        q = rearrange(out["q"].float(), "(m b) k d h w -> m b k d h w", m=len(mods))
        psnr, ssim = self._metric_objects()
        for i, m in enumerate(mods):
            target = batch[m].float()
            value = psnr(y_pred=recon[i], y=target).mean()
            psnr.reset()
            self.log(f"val/psnr_{m}", value, prog_bar=m == "image", batch_size=bs, sync_dist=True)
            if m == "image":
                value = ssim(y_pred=recon[i], y=target).mean()
                ssim.reset()
                self.log("val/ssim_image", value, batch_size=bs, sync_dist=True)
            else:
                pred, true = recon[i] > 0.5, target > 0.5
                inter = (pred & true).flatten(1).sum(1).float()
                total = (pred.flatten(1).sum(1) + true.flatten(1).sum(1)).float()
                dice = torch.where(total > 0, 2 * inter / total.clamp_min(1), torch.ones_like(total))
                self.log("val/dice_mask", dice.mean(), batch_size=bs, sync_dist=True)
        self.log("val/perplexity", self.vqvae.quantizer.perplexity.float(), batch_size=bs, sync_dist=True)
        # latent scale from the image latents (the diffusion's target); the masks share the scale
        qi = q[mods.index("image")] if "image" in mods else q
        qi = qi.double()
        self._scale_sums += torch.stack([qi.new_tensor(qi.numel()), qi.sum(), (qi**2).sum()])
        if batch_idx == 0 and self._montage is None:
            self._montage = {"subject": str(batch.get("subject", ["?"])[0])}
            for i, m in enumerate(mods):
                self._montage[m] = batch[m][0, 0].float().cpu().numpy()
                self._montage[f"{m} recon"] = recon[i][0, 0].cpu().numpy()
            if "image" in mods:
                self._montage["psnr"] = float(psnr(y_pred=recon[mods.index("image")][:1],
                                                   y=batch["image"][:1].float()).mean())
                psnr.reset()

    def on_validation_epoch_end(self) -> None:
        if self.trainer.sanity_checking or self._scale_sums is None:
            return
        sums = self.trainer.strategy.reduce(self._scale_sums, reduce_op="sum")
        n, s1, s2 = (float(v) for v in sums)
        if n > 1:
            var = max(s2 / n - (s1 / n) ** 2, 0.0) * n / (n - 1)
            if var > 0 and math.isfinite(var):
                self.latent_scale.fill_(1.0 / math.sqrt(var))
        self.log("val/latent_scale", self.latent_scale.float(), sync_dist=False)
        every = self.hparams.montage_every_n_epochs
        if self._montage is not None and every and self.current_epoch % every == 0 and self.trainer.is_global_zero:
            self._save_montage()

    def _save_montage(self) -> Path:
        m = self._montage
        columns = {k: v for k, v in m.items() if k not in ("subject", "psnr")}
        title = f"VQ-VAE {self.spec.factor}x, epoch {self.current_epoch}, step {self.global_step}, {m['subject']}"
        if "psnr" in m:
            title += f": image PSNR {m['psnr']:.2f} dB"
        path = Path(self.trainer.default_root_dir) / "montages" / f"vqvae_epoch{self.current_epoch:04d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        save_montage(path, columns, title=title)
        for logger in self.loggers:
            if hasattr(logger, "log_image"):
                logger.log_image(key="val/reconstruction", images=[str(path)], step=self.global_step)
        return path

    # ---- checkpoints: Lightning saves weights, buffers (codebook, latent scale), optimizer, schedule, loops ----
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["rng_states"] = gather_rng_states()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        check_weights_fit(self, checkpoint)  # resuming: the keys that differ, not load_state_dict's pages
        if self._trainer is not None and "rng_states" in checkpoint:  # resuming a fit
            restore_rng_states(checkpoint["rng_states"], self.trainer.global_rank)

    def on_fit_end(self) -> None:
        if float(self.latent_scale) == 1.0:
            log.warning("VQVAESystem: the latent scale was never measured (no validation epoch ran), so latents "
                        "are not rescaled; run at least one validation epoch for unit-variance latents")
