"""From a data batch to what the diffusion sees, and back: intensity ranges, encoding, the mode's split.

Intensities (one place for both directions):

* weight-free encodings (space-to-depth, Haar, identity) see the image mapped from [0, 1] to [-1, 1] and the mask
  from {0, 1} to {-1, 1}, so the data has the range of the unit-variance noise it is mixed with; generated volumes
  are mapped back (image clamped to [0, 1], mask thresholded at 0);
* learned encodings (VQ-VAE latents) see the volumes in the range they were trained on, [0, 1], and return latents
  that are already scaled for diffusion (the VQ-VAE's ``latent_scale``); decoding inverts that, and the mask is
  thresholded at 0.5.

Modes: ``bravo`` denoises the image encoding conditioned on the clean mask encoding; ``seg`` denoises the mask
encoding alone.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from einops import reduce

from voxdiff.encodings.base import Encoding, LearnedEncoding
from voxdiff.errors import ConfigError, number

MODES = ("bravo", "seg")
#: batch keys of the volumes, and of their pre-encoded latents (a latent cache)
VOLUME_KEYS = ("image", "mask")


def _learned(encoding: Encoding) -> bool:
    return isinstance(encoding, LearnedEncoding)


def to_model_range(volume: torch.Tensor, encoding: Encoding) -> torch.Tensor:
    """A volume in [0, 1] (image) or {0, 1} (mask) → the range the encoding's input expects (see module doc)."""
    volume = volume.float()
    return volume if _learned(encoding) else volume * 2.0 - 1.0


def encode_volume(encoding: Encoding, volume: torch.Tensor) -> torch.Tensor:
    """``(B, 1, D, H, W)`` volume in [0, 1] → ``(B, C_enc, d, h, w)`` float32 encoding in model range."""
    with torch.no_grad():
        return encoding.encode(to_model_range(volume, encoding)).float()


def decode_volume(encoding: Encoding, z: torch.Tensor, kind: str) -> torch.Tensor:
    """Inverse of :func:`encode_volume`: ``(B, C_enc, d, h, w)`` → ``(B, 1, D, H, W)`` float32.

    Args:
        kind: ``image`` → clamped to [0, 1]; ``mask`` → thresholded to {0, 1}.
    """
    if kind not in VOLUME_KEYS:
        raise ValueError(f"kind must be one of {VOLUME_KEYS}, got {kind!r}")
    with torch.no_grad():
        x = encoding.decode(z.float()).float()
    if _learned(encoding):
        return (x > 0.5).float() if kind == "mask" else x.clamp(0.0, 1.0)
    return (x > 0.0).float() if kind == "mask" else ((x + 1.0) / 2.0).clamp(0.0, 1.0)


def _squared_distances(features: torch.Tensor, reach: int) -> torch.Tensor:
    """``(N, C, D, H, W)`` bool → float32 squared Euclidean distance (voxels) of each voxel to its channel's nearest
    True voxel, exact up to ``reach``; further (or no True voxel) reads more than ``reach²``.

    The squared distance is separable (Saito & Toriwaki 1994): a minimum of ``f(i + k) + k²`` along each axis in
    turn. Limiting ``k`` to ``reach`` keeps it exact wherever the nearest True voxel is within ``reach`` (each of its
    offsets is), and costs ``2·reach`` shifted minima an axis in plain tensor ops: it runs on the step's device
    with no host sync, and on the preflight's meta tensors.
    """
    big = float(3 * (reach + 1) ** 2)  # above any distance the window can see
    f = torch.where(features, 0.0, big).float()
    for dim in (2, 3, 4):
        n, pad = f.shape[dim], [0] * 6
        pad[2 * (4 - dim)] = pad[2 * (4 - dim) + 1] = reach  # F.pad lists the last axis first
        padded = F.pad(f, pad, value=big)
        best = f
        for k in range(1, reach + 1):
            nearer = torch.minimum(padded.narrow(dim, reach + k, n), padded.narrow(dim, reach - k, n))
            best = torch.minimum(best, nearer + float(k * k))
        f = best
    return f


def mask_distance_map(mask: torch.Tensor, scale: float) -> torch.Tensor:
    """``(B, 1, D, H, W)`` masks in {0, 1} → ``(B, 1, D, H, W)`` float32 in [-1, 1]: a smooth map of the lesion
    whose zero level is its boundary (``diffusion.mask_sdf_scale``: what a mask model draws instead of the binary
    mask; Bogensperger et al. 2023 generate segmentations this way).

    Each voxel's signed distance ``s`` (voxels, between voxel centres and the boundary half-way between a lesion
    and a background voxel: ``+0.5`` on a lesion's edge voxel, ``-0.5`` just outside) is mapped to
    ``tanh(s / scale) / tanh((R - 0.5) / scale)`` with ``R = ⌈4·scale⌉``, clamped: a voxel ``R`` or more from any
    lesion reads exactly -1 (the empty mask is the binary one), and distances beyond ``R`` are not computed. So a
    lesion of a few voxels reaches the loss through the ``~(2R)³`` voxels around it instead of its own few, and
    the map is thresholded at 0 like the binary mask (:func:`decode_volume`).
    """
    if mask.dim() != 5 or mask.shape[1] != 1:
        raise ValueError(f"mask must be (B, 1, D, H, W), got shape {tuple(mask.shape)}")
    reach = math.ceil(4 * scale)
    lesion = mask > 0.5
    squared = _squared_distances(torch.cat([lesion, ~lesion], dim=1), reach)  # (B, 2, ...): to a lesion, to background
    to_lesion, to_background = squared.sqrt().clamp(max=reach).unbind(dim=1)
    signed = torch.where(lesion[:, 0], to_background - 0.5, 0.5 - to_lesion).unsqueeze(1)
    return (torch.tanh(signed / scale) / math.tanh((reach - 0.5) / scale)).clamp(-1.0, 1.0)


def encode_batch(
    encoding: Encoding, batch: Mapping[str, Any], mode: str, mask_sdf_scale: float | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A data batch → ``(x0, cond)`` for :meth:`voxdiff.diffusion.DiffusionProcess.loss`.

    A batch that carries ``image_z`` / ``mask_z`` (latents from a latent cache, already ``encode_volume`` of the
    volumes) is used as it is; otherwise ``image`` / ``mask`` ``(B, 1, D, H, W)`` are encoded here. This is the
    only place that decides between the two.

    Args:
        mask_sdf_scale: seg mode only (``diffusion.mask_sdf_scale``): the target is the encoding of the mask's
            distance map (:func:`mask_distance_map`) instead of the mask's; needs the full-size ``mask`` and a
            weight-free encoding. None: the mask as it is.

    Returns:
        bravo: ``x0`` the image encoding ``(B, C, d, h, w)``, ``cond`` the mask encoding ``(B, C, d, h, w)``;
        seg: ``x0`` the mask encoding, ``cond`` None. Both float32.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")

    def encoded(key: str) -> torch.Tensor:
        z = batch.get(f"{key}_z")
        if z is None:
            if key not in batch:
                raise KeyError(f"the batch has neither {key!r} nor {key + '_z'!r} (keys: {sorted(batch)})")
            return encode_volume(encoding, batch[key])
        return z.float()

    if mode == "bravo":
        return encoded("image"), encoded("mask")
    if mask_sdf_scale is None:
        return encoded("mask"), None
    if _learned(encoding) or "mask" not in batch:
        raise ValueError("a mask model's distance map (diffusion.mask_sdf_scale) is made from the full-size mask by a "
                         f"weight-free encoding; this batch has keys {sorted(batch)} and the encoding is "
                         f"{type(encoding).__name__}: set diffusion.mask_sdf_scale=null")
    with torch.no_grad():
        return encoding.encode(mask_distance_map(batch["mask"].float(), mask_sdf_scale)).float(), None


def channel_moments(encodings: Iterable[torch.Tensor]) -> dict[str, list[float]]:
    """Each channel's ``mean``, ``spread`` (the standard deviation about that mean) and ``rms`` over every voxel of
    ``encodings``, ``(B, C, d, h, w)`` tensors of one ``C`` (what :func:`encode_batch` makes of a data set), summed in
    float64: the values ``diffusion.data_mean`` and ``diffusion.sigma_data`` take (``scripts/encoding_stats.py``).

    Raises:
        ValueError: no encodings, or two of different channel counts.
    """
    total = squares = None
    count = 0
    for z in encodings:
        z = z.detach().double()
        per = reduce(z, "b c ... -> c", "sum"), reduce(z * z, "b c ... -> c", "sum")
        if total is None:
            total, squares = per
        elif per[0].shape != total.shape:
            raise ValueError(f"an encoding of {per[0].numel()} channels after ones of {total.numel()}")
        else:
            total, squares = total + per[0], squares + per[1]
        count += z[:, 0].numel()
    if total is None:
        raise ValueError("no encodings to measure")
    mean, mean_square = total / count, squares / count
    spread = (mean_square - mean * mean).clamp(min=0).sqrt()
    return {"mean": mean.tolist(), "spread": spread.tolist(), "rms": mean_square.sqrt().tolist()}


def model_input(x_t: torch.Tensor, cond: torch.Tensor | None) -> torch.Tensor:
    """What the UNet takes: the noisy ``x_t (B, C_out, d, h, w)`` with the clean condition ``cond (B, C_cond, d, h, w)``
    after it along channels, in ``x_t``'s dtype → ``(B, C_out + C_cond, d, h, w)``; ``x_t`` itself without one
    (seg mode). Every process's loss, the guided denoisers and the denoising figures build it here."""
    return x_t if cond is None else torch.cat([x_t, cond.to(x_t.dtype)], dim=1)


def check_pair(x0: torch.Tensor, cond: torch.Tensor | None) -> None:
    """``x0 (B, C_out, d, h, w)`` and ``cond (B, C_cond, d, h, w) | None`` as every process's loss takes them.

    Raises:
        ValueError: x0 is not 5-D, or cond differs from it in batch or space.
    """
    if x0.dim() != 5:
        raise ValueError(f"x0 must be (B, C, d, h, w), got shape {tuple(x0.shape)}")
    if cond is not None and (cond.shape[0] != x0.shape[0] or cond.shape[2:] != x0.shape[2:]):
        raise ValueError(f"cond {tuple(cond.shape)} does not match x0 {tuple(x0.shape)} in batch or space")


def per_sample_mses(pred: torch.Tensor, target: torch.Tensor, weights: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(plain, weighted)``: each sample's fp32 mean squared error ``(B,)`` (the UNet's prediction against the
    process's target), plain and weighted, from one squared error (what a process's loss needs: the weighted one to train on, the plain one to log).

    Args:
        weights: ``(B, 1, d, h, w)`` weights of each location's squared error, shared by the channels
            (:func:`mask_loss_weights`); the mean is then weighted (divided by the weights' sum), so a batch with no
            mask voxel has the plain MSE. None: ``weighted`` is ``plain``.
    """
    if pred.shape != target.shape:
        raise ValueError(f"the UNet returned {tuple(pred.shape)}, the target is {tuple(target.shape)}")
    squared = (pred.float() - target) ** 2
    plain = reduce(squared, "b ... -> b", "mean")
    if weights is None:
        return plain, plain
    weighted = reduce(squared * weights, "b ... -> b", "sum")
    return plain, weighted / (reduce(weights, "b ... -> b", "sum") * pred.shape[1])


def check_mask_weight(value: Any) -> float:
    """Validate ``diffusion.mask_weight`` (both processes): a finite number ≥ 0.

    Raises:
        ConfigError: naming the key, the value and a fix.
    """
    return number("diffusion.mask_weight", value, lo=0,
                  fix="use 0 for the plain loss, or e.g. diffusion.mask_weight=10 to count lesion voxels 11 times")


def check_mask_sdf_scale(value: Any, mask_weight: float = 0.0) -> float | None:
    """Validate ``diffusion.mask_sdf_scale`` (both processes): null, or a number of voxels in (0, 16], and then
    ``diffusion.mask_weight`` 0 (the weight's bias is undone on a binary mask's probabilities,
    :func:`unweighted_mask_prediction`, which a distance map is not).

    Raises:
        ConfigError: naming the key, the value and a fix.
    """
    if value is None:
        return None
    scale = number("diffusion.mask_sdf_scale", value, lo=0, hi=16, lo_open=True,
                   fix="use null (the binary mask), or e.g. diffusion.mask_sdf_scale=2 (voxels) for a mask model")
    if mask_weight:
        raise ConfigError("diffusion.mask_weight", mask_weight, f"biases what a mask model draws, and with "
                          f"diffusion.mask_sdf_scale={scale:g} (a distance map, not lesion probabilities) that bias "
                          "cannot be undone", "set diffusion.mask_weight=0, or diffusion.mask_sdf_scale=null")
    return scale


def mask_loss_weights(batch: Mapping[str, Any], x0: torch.Tensor, mask_weight: float) -> torch.Tensor:
    """``(B, 1, d, h, w)`` fp32 weights of the loss (``diffusion.mask_weight``): ``1 + mask_weight`` where the block
    of voxels that an element of the encoding ``x0 (B, C, d, h, w)`` stands for touches the mask, else 1.

    The batch's full-size mask ``(B, 1, D, H, W)`` (volume batches, and latent batches that carry it) is max-pooled
    to the encoding's grid, whatever the encoding: a lesion smaller than a block still weights the whole block.

    Raises:
        ValueError: the batch carries no full-size ``mask``, or its size is not a multiple of the encoding's.
    """
    mask = batch.get("mask")
    if mask is None:
        raise ValueError("diffusion.mask_weight weights the loss by the full-size mask, and this batch has none "
                         f"(keys: {sorted(batch)}): serve the masks (a latent run: data.masks=true), or set "
                         "diffusion.mask_weight=0")
    full, grid = tuple(mask.shape[2:]), tuple(x0.shape[2:])
    if len(full) != 3 or any(f % g for f, g in zip(full, grid)):
        raise ValueError(f"the mask {tuple(mask.shape)} does not tile the encoding's grid {grid}")
    kernel = tuple(f // g for f, g in zip(full, grid))
    m = mask.to(x0.device, torch.float32)
    if kernel != (1, 1, 1):
        m = F.max_pool3d(m, kernel_size=kernel, stride=kernel)  # (B, 1, d, h, w)
    return 1.0 + mask_weight * (m > 0.5).float()


def mask_weight_to_undo(mode: str, diffusion: Any, weight_free: bool) -> float:
    """The ``diffusion.mask_weight`` (of the process settings ``diffusion``) whose bias a sampler undoes at each
    step (:func:`unweighted_mask_prediction`): a mask model's (``mode=seg``, where the weight is set by what is
    drawn) on a ``weight_free`` encoding; 0 where there is nothing to undo (bravo: the weight comes from the
    condition, which the model sees) or it cannot be undone (a learned encoding)."""
    weight = float(getattr(diffusion, "mask_weight", 0.0) or 0.0)
    return weight if mode == "seg" and weight_free else 0.0


def unweighted_mask_prediction(x0: torch.Tensor, encoding: Encoding, mask_weight: float) -> torch.Tensor:
    """A seg model's predicted clean mask encoding ``x0 (B, C, d, h, w)`` (weight-free encoding, model range),
    trained with ``diffusion.mask_weight`` ``w > 0``, turned into the prediction of the unweighted loss.

    Why: the loss counts a block of voxels ``1 + w`` times where it touches the mask (:func:`mask_loss_weights`),
    and in seg mode that weight is set by the target itself, so the weighted MSE's minimiser is not the posterior
    mean but ``E[W·x₀ | x_t] / E[W | x_t]``: lesion outcomes counted ``1 + w`` times. For a voxel that is lesion
    with probability ``p`` in a block touched with probability ``q``, the model predicts (in mask units, [0, 1])
    ``p̂ = (1 + w)·p / (1 + w·q)`` — at ``w = 20`` a voxel with ``p = q = 0.01`` reads 0.175 — and the sampler
    draws masks with many times the real lesion load (``docs/demo_recipe.md``, "Mask generation"). The weight is
    shared by the block's channels and the encoding is linear in each block, so the decoded voxels carry the same
    bias, and it is inverted per voxel: ``p = p̂ / (1 + w·(1 − q̂))``, with the block's ``q`` taken as its most
    likely voxel's (``q̂ = max p̂``; exact where the block is one voxel, the identity encoding, and where a
    block's lesion voxels are nested events; otherwise ``q`` ≥ that, so lesions are, if anything, still
    over-drawn). Predictions are clamped to [0, 1] first.

    Returns:
        ``(B, C, d, h, w)`` float32: the corrected x₀ encoding. In bravo mode the weight comes from the condition,
        which the model sees, so its minimiser is unbiased and nothing needs undoing.

    Raises:
        ValueError: a learned encoding (its decoder is not linear: the bias cannot be undone voxel by voxel).
    """
    if _learned(encoding):
        raise ValueError("a learned encoding's prediction cannot be unweighted voxel by voxel (its decoder is not "
                         "linear): train its mask model with diffusion.mask_weight=0")
    with torch.no_grad():
        u = ((encoding.decode(x0.float()).float() + 1.0) / 2.0).clamp(0.0, 1.0)  # (B, 1, D, H, W): p̂ per voxel
        full, grid = u.shape[2:], x0.shape[2:]
        kernel = tuple(f // g for f, g in zip(full, grid))
        if kernel != (1, 1, 1):  # each voxel its block's q̂: the block's max (B, 1, d, h, w) back at (B, 1, D, H, W)
            top = F.interpolate(F.max_pool3d(u, kernel_size=kernel, stride=kernel), size=tuple(full), mode="nearest")
        else:
            top = u
        p = u / (1.0 + mask_weight * (1.0 - top))
        return encoding.encode(p * 2.0 - 1.0).float()


def encoded_range(encoding: Encoding) -> float | None:
    """The largest absolute value an encoding of a volume in [-1, 1] can take; None for learned encodings.

    Weight-free encodings are linear maps on ``f×f×f`` blocks, so the bound is the largest L1 norm of a row of
    the block matrix: 1 for space-to-depth and identity, 2√2 for the orthonormal Haar transform. DDIM clips its
    x₀ predictions to this range.
    """
    if _learned(encoding):
        return None
    f = int(getattr(encoding, "factor", 1))
    n = f**3
    basis = torch.eye(n, dtype=torch.float64).reshape(n, 1, f, f, f)  # one voxel of the block set per sample
    columns = encoding.encode(basis).reshape(n, -1)  # (n inputs, n outputs): the block matrix, transposed
    return float(columns.abs().sum(dim=0).max())
