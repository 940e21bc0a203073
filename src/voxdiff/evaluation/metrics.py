"""The figures of an evaluation, each computed by a library metric (MONAI) on float64 tensors.

Volumes are ``(N, 1, D, H, W)`` tensors in [0, 1] (images) or {0, 1} (masks); feature sets are ``(N, F)``.

* Structural similarity: MONAI's ``SSIMMetric``, ``MultiScaleSSIMMetric`` and ``PSNRMetric`` with the settings
  of :data:`SSIM_SETTINGS` and :data:`MS_SSIM_SETTINGS` (data range 1).
* Diversity: the mean MS-SSIM over the ``N·(N-1)/2`` unordered pairs of a set, or a seeded random subset of them
  (:func:`pairwise_ms_ssim`).
* Distribution: MONAI's ``MMDMetric`` (unbiased, linear kernel) on intensity histograms (:func:`histograms`),
  and the Fréchet distance of two feature sets through MONAI's ``FIDMetric`` (:func:`frechet_distance`), made
  safe for ``N`` smaller than the feature dimension.
* Codebook usage of a VQ-VAE from its code indices (:func:`codebook_usage`).
* Anatomy (:func:`anatomy_comparison`): inside each volume's own head, the sharpness (mean gradient magnitude of the
  volume smoothed by a voxel, MONAI's ``GaussianFilter``), the shares of intensity classes (CSF-dark, grey, deep
  grey, bright), generated against real.

MONAI's ``MultiScaleSSIMMetric`` with its defaults (11-voxel kernel, the five weights of Wang et al. 2003)
refuses any axis of 160 voxels or less, i.e. every shape voxdiff trains on. voxdiff uses a 5-voxel Gaussian
kernel (σ 1.5) and three scales with Wang et al.'s first three weights renormalised to sum to 1; that needs
every axis ≥ :data:`MS_SSIM_MIN_SIZE` (20) and works for all configured experiments (the smallest axis is 32).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F

from voxdiff.errors import ConfigError

#: Wang, Simoncelli & Bovik (2003) MS-SSIM weights for five scales (MONAI's default)
WANG_WEIGHTS = (0.0448, 0.2856, 0.3001, 0.2363, 0.1333)


@dataclass(frozen=True)
class SSIMSettings:
    """Arguments of MONAI's ``SSIMMetric`` / ``MultiScaleSSIMMetric`` (3D, Gaussian kernel, data range 1)."""

    kernel_size: int
    kernel_sigma: float
    weights: tuple[float, ...] = ()  # MS-SSIM only: one weight per scale, finest first
    k1: float = 0.01
    k2: float = 0.03
    data_range: float = 1.0

    @property
    def min_size(self) -> int:
        """The smallest axis MONAI's MS-SSIM accepts with these settings: ``axis // (scales - 1)² > kernel - 1``."""
        return self.kernel_size * max(1, len(self.weights) - 1) ** 2

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["weights"] = list(self.weights)
        return d


#: single-scale SSIM: a 7-voxel Gaussian window (σ 1.5)
SSIM_SETTINGS = SSIMSettings(kernel_size=7, kernel_sigma=1.5)
#: MS-SSIM: a 5-voxel Gaussian kernel (σ 1.5) at three scales, Wang et al.'s first three weights renormalised
MS_SSIM_SETTINGS = SSIMSettings(
    kernel_size=5,
    kernel_sigma=1.5,
    weights=tuple(round(w / sum(WANG_WEIGHTS[:3]), 6) for w in WANG_WEIGHTS[:3]),
)
#: the smallest axis MS_SSIM_SETTINGS works on
MS_SSIM_MIN_SIZE = MS_SSIM_SETTINGS.min_size
#: ``ms_ssim=`` presets: voxdiff's (any axis >= 20), and WDM's evaluation (Friedrich et al. 2024, eval/ms_ssim.py:
#: kernel 7 with MONAI's five default weights; axes >= 112, e.g. their 128^3 and 256^3 volumes)
MS_SSIM_PRESETS: dict[str, SSIMSettings] = {
    "voxdiff": MS_SSIM_SETTINGS,
    "wdm": SSIMSettings(kernel_size=7, kernel_sigma=1.5, weights=WANG_WEIGHTS),
}


def check_volume_shape(shape: tuple[int, ...], settings: SSIMSettings = MS_SSIM_SETTINGS,
                       key: str = "data.volume_shape") -> None:
    """Refuse a volume too small for the MS-SSIM ``settings`` (every axis must be ≥ ``settings.min_size``).

    Raises:
        ConfigError: naming ``key``, the shape and a fix.
    """
    if min(shape) < settings.min_size:
        fix = f"evaluate a model trained on volumes of at least {settings.min_size} voxels per axis"
        if settings != MS_SSIM_SETTINGS:
            fix += f", or use ms_ssim=voxdiff (axes >= {MS_SSIM_MIN_SIZE})"
        raise ConfigError(key, list(shape),
                          f"MS-SSIM ({len(settings.weights)} scales, kernel {settings.kernel_size}) "
                          f"needs every axis >= {settings.min_size}", fix)


def _pair(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if a.shape != b.shape or a.dim() != 5 or a.shape[1] != 1:
        raise ValueError(f"expected two (N, 1, D, H, W) volumes of one shape, got {tuple(a.shape)} and "
                         f"{tuple(b.shape)}")
    return a, b


#: float64 voxels per MONAI call; SSIM keeps about ten maps of its input's size, so this bounds it near 3 GB
VOXELS_PER_CALL = 40_000_000


def _chunks(n: int, voxels: int) -> list[slice]:
    """Slices of ``range(n)`` holding at most :data:`VOXELS_PER_CALL` voxels each (at least one volume)."""
    size = max(1, VOXELS_PER_CALL // max(voxels, 1))
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


def _per_pair(metric, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``metric(a[i], b[i])`` for every pair, in chunks, as ``(N,)`` float64 (inputs cast per chunk)."""
    a, b = _pair(a, b)
    return torch.cat([metric(a[c].double(), b[c].double()).reshape(-1).double()
                      for c in _chunks(a.shape[0], a[0].numel())])


def ssim(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """SSIM of each pair ``a[i]``, ``b[i]`` (``(N, 1, D, H, W)`` in [0, 1]) → ``(N,)`` float64, MONAI ``SSIMMetric``."""
    from monai.metrics import SSIMMetric

    s = SSIM_SETTINGS
    metric = SSIMMetric(spatial_dims=3, data_range=s.data_range, kernel_type="gaussian", win_size=s.kernel_size,
                        kernel_sigma=s.kernel_sigma, k1=s.k1, k2=s.k2, reduction="none")
    return _per_pair(metric, a, b)


def ms_ssim(a: torch.Tensor, b: torch.Tensor, settings: SSIMSettings = MS_SSIM_SETTINGS) -> torch.Tensor:
    """MS-SSIM of each pair (``(N, 1, D, H, W)`` in [0, 1]) → ``(N,)`` float64, MONAI ``MultiScaleSSIMMetric``
    with ``settings`` (default :data:`MS_SSIM_SETTINGS`)."""
    from monai.metrics import MultiScaleSSIMMetric

    check_volume_shape(tuple(a.shape[2:]), settings)
    s = settings
    metric = MultiScaleSSIMMetric(spatial_dims=3, data_range=s.data_range, kernel_type="gaussian",
                                  kernel_size=s.kernel_size, kernel_sigma=s.kernel_sigma, k1=s.k1, k2=s.k2,
                                  weights=s.weights, reduction="none")
    return _per_pair(metric, a, b)


def psnr(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """PSNR in dB of each pair (``(N, 1, D, H, W)`` in [0, 1], peak 1) → ``(N,)`` float64, MONAI ``PSNRMetric``."""
    from monai.metrics import PSNRMetric

    return _per_pair(PSNRMetric(max_val=1.0, reduction="none"), a, b)


def pair_indices(n: int, picks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(i, j)`` of the unordered pairs ``picks`` indexes, in ``itertools.combinations(range(n), 2)`` order: pair
    ``k`` is the ``k``-th of ``(0, 1), (0, 2), ..., (0, n-1), (1, 2), ...``; ``picks`` ``(K,)`` int64 in
    ``[0, n·(n-1)/2)``."""
    per_row = torch.arange(n - 1, 0, -1)  # the pairs whose first index is i
    starts = torch.cumsum(per_row, 0) - per_row
    i = torch.searchsorted(starts, picks, right=True) - 1
    return i, i + 1 + (picks - starts[i])


@dataclass(frozen=True)
class Pairs:
    """The MS-SSIM of pairs of one set of ``n`` volumes: pair ``k`` is volumes ``i[k]`` and ``j[k]`` (``i < j``),
    its MS-SSIM ``values[k]``; ``all_pairs`` = n·(n-1)/2, ``sampled``: the pairs were drawn from them."""

    i: torch.Tensor
    j: torch.Tensor
    values: torch.Tensor
    n: int
    all_pairs: int
    sampled: bool

    def summary(self) -> dict[str, float | int | bool]:
        """``{"value": mean, "std": standard deviation over pairs, "n": N, "pairs": pairs computed,
        "all_pairs": N·(N-1)/2, "sampled": whether the pairs were drawn}``."""
        v = self.values
        return {"value": float(v.mean()), "std": float(v.std()) if len(v) > 1 else 0.0, "n": self.n,
                "pairs": len(v), "all_pairs": self.all_pairs, "sampled": self.sampled}


def ms_ssim_pairs(volumes: torch.Tensor, settings: SSIMSettings = MS_SSIM_SETTINGS, max_pairs: int | None = None,
                  seed: int = 0) -> Pairs:
    """The MS-SSIM of the unordered pairs of a set (the diversity figure: their mean, lower = more diverse): all of
    them, or, when there are more than ``max_pairs``, ``max_pairs`` distinct pairs drawn at random (seeded by
    ``seed``), as the field measures diversity over large sample sets (N = 1000 volumes make 499,500 pairs).

    Args:
        volumes: ``(N, 1, D, H, W)`` in [0, 1], ``N >= 2``.
        settings: the MS-SSIM settings.
        max_pairs: the most pairs to compute (None: every pair).
        seed: the seed of the pairs drawn.
    """
    n = volumes.shape[0]
    if n < 2:
        raise ValueError(f"pairwise MS-SSIM needs at least 2 volumes, got {n}")
    total = n * (n - 1) // 2
    sampled = max_pairs is not None and total > max_pairs
    picks = (torch.randperm(total, generator=torch.Generator().manual_seed(seed))[:max_pairs].sort().values
             if sampled else torch.arange(total))
    i, j = pair_indices(n, picks)
    step = max(1, VOXELS_PER_CALL // volumes[0].numel())  # index per chunk: never a copy of every pair at once
    a, b = i.tolist(), j.tolist()
    v = torch.cat([ms_ssim(volumes[a[k : k + step]], volumes[b[k : k + step]], settings)
                   for k in range(0, len(a), step)])
    return Pairs(i, j, v, n, total, sampled)


def pairwise_ms_ssim(volumes: torch.Tensor, settings: SSIMSettings = MS_SSIM_SETTINGS, max_pairs: int | None = None,
                     seed: int = 0) -> dict[str, float | int | bool]:
    """The diversity figure: :meth:`Pairs.summary` of :func:`ms_ssim_pairs`."""
    return ms_ssim_pairs(volumes, settings, max_pairs, seed).summary()


def summary(values: torch.Tensor) -> dict[str, float | int]:
    """``{"value": mean, "std", "n"}`` of per-sample figures ``(N,)``."""
    v = values.double().reshape(-1)
    return {"value": float(v.mean()), "std": float(v.std()) if len(v) > 1 else 0.0, "n": int(len(v))}


def lesion_shell(masks: torch.Tensor, width: int = 2) -> torch.Tensor:
    """The ``width``-voxel shell around each mask (dilation minus the mask): ``(N, 1, D, H, W)`` bool."""
    m = masks > 0.5
    dilated = F.max_pool3d(m.float(), kernel_size=2 * width + 1, stride=1, padding=width) > 0.5
    return dilated & ~m


#: the regions of :func:`intensity_sums`, in order
REGIONS = ("inside", "shell", "outside")


def intensity_sums(images: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """Per volume and region (inside the mask, its 2-voxel shell, outside it): the voxel count, Σx and Σx².

    Args:
        images: ``(N, 1, D, H, W)`` in [0, 1].
        masks: ``(N, 1, D, H, W)`` in {0, 1}.

    Returns:
        ``(N, 3, 3)`` float64: volume × region (:data:`REGIONS`) × (count, Σx, Σx²).
    """
    rows = []
    for x, m in zip(images, masks):  # volume by volume: a few bool copies of one volume in memory
        x, m = x.double(), m[None]
        inside, shell = (m > 0.5)[0], lesion_shell(m)[0]
        rows.append(torch.stack([torch.stack([x.new_tensor(v.numel()), v.sum(), (v * v).sum()])
                                 for v in (x[region] for region in (inside, shell, ~inside))]))
    return torch.stack(rows)


def lesion_contrast(sums: torch.Tensor) -> torch.Tensor:
    """Mean intensity inside the masks minus the mean of their shells, pooled over a set: per-volume
    :func:`intensity_sums` ``(..., N, 3, 3)`` → ``(...)`` (NaN where a set has no voxel in a region)."""
    t = sums.sum(-3)
    return t[..., 0, 1] / t[..., 0, 0] - t[..., 1, 1] / t[..., 1, 0]


def intensity_stats(images: torch.Tensor, masks: torch.Tensor, sums: torch.Tensor | None = None
                    ) -> dict[str, float]:
    """Intensity inside the masks, in a 2-voxel shell around them and outside them, pooled over the set.

    Args:
        images: ``(N, 1, D, H, W)`` in [0, 1].
        masks: ``(N, 1, D, H, W)`` in {0, 1}.
        sums: their :func:`intensity_sums` where already computed.

    Returns:
        ``mean_inside``, ``std_inside``, ``mean_shell``, ``mean_outside``, ``std_outside`` and ``contrast``
        (:func:`lesion_contrast`: how much the lesion stands out from the tissue around it).
    """
    sums = intensity_sums(images, masks) if sums is None else sums
    out: dict[str, float] = {}
    for (n, s1, s2), name in zip(sums.sum(0).tolist(), REGIONS):
        out[f"mean_{name}"] = s1 / n if n else math.nan
        out[f"std_{name}"] = math.sqrt(max(s2 / n - (s1 / n) ** 2, 0.0) * n / (n - 1)) if n > 1 else math.nan
    out["contrast"] = float(lesion_contrast(sums))
    return out


#: anatomy figures (:func:`anatomy_stats`): a voxel is in the head where the volume smoothed with a Gaussian of
#: :data:`HEAD_SMOOTHING` voxels exceeds :data:`HEAD_THRESHOLD` (background is 0 plus noise; every tissue of the phantom
#: but CSF and the skull's tables is above 0.3), with the holes of each axial slice filled (the dark CSF rim, skull
#: tables and ventricles lie inside the bright scalp ring)
HEAD_SMOOTHING = 1.0
HEAD_THRESHOLD = 0.15
#: the σ (voxels) of the Gaussian applied before the gradient of the sharpness figure: it keeps tissue edges and
#: suppresses voxel noise (the phantom's Rician noise, σ 0.012-0.022, or a sampler's leftover noise), so that a
#: noisy volume does not pass for a sharp one
SHARPNESS_SMOOTHING = 1.0
#: intensity classes of the tissue fractions: upper bounds (the last class ends at 1). On the phantom's T1:
#: CSF, ventricles and the skull's tables are 0.07-0.10, grey matter 0.42, deep grey 0.56, white matter 0.70,
#: scalp fat 0.80, enhancing lesions 0.95; 0.25 is ``voxdiff.data.phantom``'s CSF threshold
TISSUE_CLASSES: dict[str, float] = {"dark": 0.25, "grey": 0.49, "deep_grey": 0.63, "bright": math.inf}


def _smooth(volumes: torch.Tensor, sigma: float) -> torch.Tensor:
    """``(N, 1, D, H, W)`` → the same, smoothed by MONAI's ``GaussianFilter`` (σ in voxels, float64)."""
    from monai.networks.layers import GaussianFilter

    return GaussianFilter(spatial_dims=3, sigma=sigma)(volumes.double())


def head_mask(volumes: torch.Tensor) -> torch.Tensor:
    """The head of each volume: ``(N, 1, D, H, W)`` in [0, 1] → ``(N, 1, D, H, W)`` bool.

    Foreground of the volume smoothed by :data:`HEAD_SMOOTHING` voxels above :data:`HEAD_THRESHOLD`, holes filled
    in every axial slice (the last axis is inferior → superior): the CSF, skull and ventricles inside the scalp.
    Computed on each volume alone, so a generated head is measured inside its own outline.
    """
    from scipy.ndimage import binary_fill_holes

    fg = (_smooth(volumes, HEAD_SMOOTHING) > HEAD_THRESHOLD).numpy()
    for n in range(fg.shape[0]):
        for k in range(fg.shape[-1]):
            fg[n, 0, :, :, k] = binary_fill_holes(fg[n, 0, :, :, k])
    return torch.from_numpy(fg)


def anatomy_stats(volumes: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-volume figures of how much anatomy a volume draws, inside its own head (:func:`head_mask`).

    Args:
        volumes: ``(N, 1, D, H, W)`` in [0, 1].

    Returns:
        ``sharpness`` ``(N,)``: the mean gradient magnitude (central finite differences, intensity per voxel) of the
        volume smoothed by :data:`SHARPNESS_SMOOTHING` voxels, over the head: tissue edges (skull ring, ventricle
        walls, cortex) raise it, a blurred head lowers it;
        ``fractions`` ``(N, K)``: the share of head voxels in each class of :data:`TISSUE_CLASSES` (rows sum to 1);
        ``head_voxels`` ``(N,)``.
    """
    if volumes.dim() != 5 or volumes.shape[1] != 1:
        raise ValueError(f"expected (N, 1, D, H, W) volumes, got {tuple(volumes.shape)}")
    edges = [-math.inf, *TISSUE_CLASSES.values()]
    sharpness, fractions, counts = [], [], []
    for n in range(volumes.shape[0]):  # one volume at a time: a few float64 copies of one volume in memory
        x = volumes[n : n + 1].double()
        region = head_mask(x)[0, 0]
        grads = torch.gradient(_smooth(x, SHARPNESS_SMOOTHING)[0, 0])
        magnitude = torch.sqrt(sum(g * g for g in grads))
        count = int(region.sum())
        v = x[0, 0][region]
        nan = x.new_tensor(math.nan)
        sharpness.append(magnitude[region].mean() if count else nan)
        fractions.append(torch.stack([((v >= lo) & (v < hi)).double().mean() if count else nan
                                      for lo, hi in zip(edges[:-1], edges[1:])]))
        counts.append(count)
    return {"sharpness": torch.stack(sharpness), "fractions": torch.stack(fractions),
            "head_voxels": torch.tensor(counts, dtype=torch.float64)}


def tissue_distance(generated: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """Total-variation distance ½·Σ|p_gen − p_real| between the mean class shares of two sets: per-volume
    ``fractions`` of :func:`anatomy_stats`, ``(..., N, K)`` and ``(..., R, K)`` → ``(...)`` (volumes without a head,
    NaN rows, left out of the means)."""
    return 0.5 * (generated.nanmean(-2) - real.nanmean(-2)).abs().sum(-1)


def anatomy_comparison(generated: torch.Tensor, real: torch.Tensor,
                       stats: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]] | None = None
                       ) -> dict[str, Any]:
    """Does a generated set draw the anatomy of the real one? :func:`anatomy_stats` of both sets, compared.

    Args:
        generated, real: ``(N, 1, D, H, W)`` and ``(R, 1, D, H, W)`` in [0, 1] (any N, R ≥ 1).
        stats: their :func:`anatomy_stats` where already computed.

    Returns:
        ``sharpness_ratio`` (mean sharpness generated ÷ real: 1 = as sharp as the data, a blurred head well below),
        ``sharpness_generated``, ``sharpness_real`` (each ``{"value", "std", "n"}``), ``fractions_generated`` and
        ``fractions_real`` (``{class: mean share of head voxels}``), ``tissue_distance`` (:func:`tissue_distance`:
        0 = the same tissue mix, 1 = disjoint) and ``dark_ratio`` (share of CSF-dark head voxels, generated ÷ real:
        0 when no generated voxel is CSF-dark).
    """
    gen, ref = stats if stats is not None else (anatomy_stats(generated), anatomy_stats(real))
    p_gen, p_ref = gen["fractions"].nanmean(0), ref["fractions"].nanmean(0)
    names = list(TISSUE_CLASSES)
    s_gen, s_ref = summary(gen["sharpness"]), summary(ref["sharpness"])
    dark = names.index("dark")
    return {
        "sharpness_ratio": s_gen["value"] / s_ref["value"] if s_ref["value"] > 0 else math.nan,
        "sharpness_generated": s_gen, "sharpness_real": s_ref,
        "fractions_generated": dict(zip(names, p_gen.tolist())), "fractions_real": dict(zip(names, p_ref.tolist())),
        "tissue_distance": float(tissue_distance(gen["fractions"], ref["fractions"])),
        "dark_ratio": float(p_gen[dark] / p_ref[dark]) if p_ref[dark] > 0 else math.nan,
        "head_voxels_generated": summary(gen["head_voxels"]), "head_voxels_real": summary(ref["head_voxels"]),
    }


def histograms(volumes: torch.Tensor, bins: int = 64, masks: torch.Tensor | None = None,
               inside: bool = True) -> torch.Tensor:
    """Normalised intensity histograms over [0, 1], one per volume: ``(N, bins)`` float64 summing to 1.

    Args:
        volumes: ``(N, 1, D, H, W)`` (values outside [0, 1] fall in the end bins).
        bins: number of equal bins.
        masks: optional ``(N, 1, D, H, W)``: count only voxels inside (``inside``) or outside the mask.
    """
    rows = []
    for i in range(volumes.shape[0]):
        v = volumes[i].double().clamp(0.0, 1.0)
        if masks is not None:
            region = masks[i] > 0.5
            v = v[region if inside else ~region]
        h = torch.histc(v.reshape(-1), bins=bins, min=0.0, max=1.0)
        rows.append(h / h.sum().clamp_min(1.0))
    return torch.stack(rows)


def mmd(generated: torch.Tensor, real: torch.Tensor) -> dict[str, float | int]:
    """Unbiased MMD² with a linear kernel (MONAI ``MMDMetric``) between two feature sets ``(N, F)``.

    MONAI needs sets of one size: the first ``min(N_gen, N_real)`` rows of each are used (≥ 2).
    """
    from monai.metrics import MMDMetric

    n = min(generated.shape[0], real.shape[0])
    if n < 2:
        raise ValueError(f"MMD needs at least 2 volumes per set, got {generated.shape[0]} and {real.shape[0]}")
    value = MMDMetric()(generated[:n].double(), real[:n].double())
    return {"value": float(value), "n": n}


def frechet_distance(generated: torch.Tensor, real: torch.Tensor) -> dict[str, Any]:
    """Fréchet distance between Gaussians fitted to two feature sets ``(N, F)``, via MONAI's ``FIDMetric``.

    Safe for small ``N`` (fewer samples than features, where both covariances are singular): MONAI's
    ``FIDMetric`` (float64, SciPy's ``sqrtm`` of ``Σ_g Σ_r``) is tried first. When it fails (a complex square root
    with a large imaginary part, the error of wdm-3d #11; a single sample) or is not finite, the distance is
    recomputed exactly in an orthonormal basis of the span of both sets' centred features and their mean
    difference (at most ``N_gen + N_real - 1`` dimensions; every term of the distance lies in it), with the
    trace term from the symmetric form ``tr sqrt(Σ_g Σ_r) = Σ_i sqrt(λ_i(Σ_r^½ Σ_g Σ_r^½))``, eigenvalues clipped
    at 0: exact for positive semi-definite covariances, and it cannot fail.

    The result is clipped at 0 (it is ≥ 0 mathematically; SciPy's route gives about -1e-4 for a set against
    itself at N=8, F=512).

    Returns:
        ``{"value", "n_generated", "n_real", "dim", "sqrtm"}`` (``sqrtm``: ``scipy`` or ``symmetric-eig``).
    """
    from monai.metrics import FIDMetric

    g, r = generated.double(), real.double()
    if g.dim() != 2 or r.dim() != 2 or g.shape[1] != r.shape[1]:
        raise ValueError(f"expected two (N, F) feature sets of one F, got {tuple(g.shape)} and {tuple(r.shape)}")
    if min(g.shape[0], r.shape[0]) < 2:
        raise ValueError(f"a Fréchet distance needs at least 2 samples per set, got {g.shape[0]} and {r.shape[0]}")
    method = "scipy"
    try:
        with warnings.catch_warnings():  # SciPy warns about ill-conditioned products; the check below decides
            warnings.simplefilter("ignore")
            value = float(FIDMetric()(g, r))
    except ValueError:  # "Imaginary component ... too high"
        value = math.nan
    if not math.isfinite(value):
        method = "symmetric-eig"
        value = _frechet_symmetric(g, r)
    return {"value": max(value, 0.0), "n_generated": int(g.shape[0]), "n_real": int(r.shape[0]),
            "dim": int(g.shape[1]), "sqrtm": method}


def _psd_sqrt(m: torch.Tensor) -> torch.Tensor:
    w, v = torch.linalg.eigh((m + m.T) / 2)
    return (v * w.clamp_min(0).sqrt()) @ v.T


def _frechet_symmetric(g: torch.Tensor, r: torch.Tensor) -> float:
    """The Fréchet distance of ``(N, F)`` float64 sets in the span of their data, with the symmetric trace term."""
    mu_g, mu_r = g.mean(0), r.mean(0)
    _, s, vh = torch.linalg.svd(torch.cat([g - mu_g, r - mu_r, (mu_g - mu_r)[None]]), full_matrices=False)
    basis = vh[: max(int((s > s.max() * 1e-12).sum()), 1)].T  # (F, k), orthonormal columns
    g, r = g @ basis, r @ basis  # the distance is unchanged: every term lies in this span
    cov_g, cov_r = torch.cov(g.T).reshape(g.shape[1], -1), torch.cov(r.T).reshape(r.shape[1], -1)
    root_r = _psd_sqrt(cov_r)
    eig = torch.linalg.eigvalsh(root_r @ cov_g @ root_r).clamp_min(0)
    diff = g.mean(0) - r.mean(0)
    return float(diff @ diff + cov_g.trace() + cov_r.trace() - 2 * eig.sqrt().sum())


def codebook_usage(indices: torch.Tensor, num_embeddings: int) -> dict[str, float | int]:
    """How a VQ-VAE uses its codebook over a set of code indices (any shape, values in ``[0, num_embeddings)``).

    Returns:
        ``perplexity`` (exp of the entropy of the code histogram: the effective number of codes in use, from 1 to
        ``num_embeddings``), ``used`` (codes used at least once), ``dead`` (codes never used) and ``n_latents``.
    """
    counts = torch.bincount(indices.reshape(-1).long(), minlength=num_embeddings).double()
    p = counts / counts.sum()
    entropy = -(p[p > 0] * p[p > 0].log()).sum()
    used = int((counts > 0).sum())
    return {"perplexity": float(entropy.exp()), "used": used, "dead": num_embeddings - used,
            "num_embeddings": num_embeddings, "n_latents": int(counts.sum())}


def _centred(x: Any, y: Any, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Two equal-length sequences (at least 2 each) as float64 tensors less their means; ``what`` names the figure
    in the ValueError otherwise."""
    a = torch.as_tensor(list(x), dtype=torch.float64)
    b = torch.as_tensor(list(y), dtype=torch.float64)
    if a.numel() != b.numel() or a.numel() < 2:
        raise ValueError(f"{what} needs two sequences of the same length >= 2, got {a.numel()} and {b.numel()}")
    return a - a.mean(), b - b.mean()


def correlation(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Pearson's r along the last axis of float64 ``(..., N)`` tensors → ``(...)``; NaN where either is constant."""
    a, b = x - x.mean(-1, keepdim=True), y - y.mean(-1, keepdim=True)
    denominator = a.norm(dim=-1) * b.norm(dim=-1)
    return torch.where(denominator > 0, (a * b).sum(-1) / denominator, math.nan)


def pearson(x: Any, y: Any) -> dict[str, float | int]:
    """Pearson's r (:func:`correlation`) of two equal-length sequences (float64) with its N; NaN when either is
    constant."""
    a, b = _centred(x, y, "pearson")
    return {"value": float(correlation(a, b)), "n": int(a.numel())}


def slope(x: Any, y: Any) -> dict[str, float | int]:
    """The least-squares slope of ``y`` on ``x`` (:func:`least_squares_slope`; two equal-length sequences,
    float64), with its standard error (from the residuals; NaN below 3 points) and N; the slope is NaN when ``x`` is
    constant."""
    a, b = _centred(x, y, "slope")
    sxx = float(a @ a)
    if sxx == 0:
        return {"value": math.nan, "se": math.nan, "n": int(a.numel())}
    k = float(least_squares_slope(a, b))
    residual = b - k * a
    se = math.sqrt(float(residual @ residual) / (a.numel() - 2) / sxx) if a.numel() > 2 else math.nan
    return {"value": k, "se": se, "n": int(a.numel())}


def group_slopes(x: Any, y: Any, groups: Any) -> torch.Tensor:
    """Each group's least-squares slope of ``y`` on ``x`` (:func:`slope`), in the order the groups first appear:
    ``(groups,)`` float64.

    Raises:
        ValueError: sequences of different lengths, or a group with fewer than 2 distinct values of ``x``.
    """
    x, y, groups = list(x), list(y), list(groups)
    if not len(x) == len(y) == len(groups):
        raise ValueError(f"paired_effect needs sequences of one length, got {len(x)}, {len(y)} and {len(groups)}")
    members: dict[Any, list[int]] = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    slopes = []
    for g, idx in members.items():
        if len({x[i] for i in idx}) < 2:
            raise ValueError(f"paired_effect: group {g!r} has fewer than 2 distinct values of x")
        slopes.append(slope([x[i] for i in idx], [y[i] for i in idx])["value"])
    return torch.tensor(slopes, dtype=torch.float64)


def least_squares_slope(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The least-squares slope of ``y`` on ``x`` along the last axis of float64 ``(..., N)`` tensors → ``(...)``;
    NaN where ``x`` is constant."""
    a, b = x - x.mean(-1, keepdim=True), y - y.mean(-1, keepdim=True)
    sxx = (a * a).sum(-1)
    return torch.where(sxx > 0, (a * b).sum(-1) / sxx, math.nan)


def paired_effect(x: Any, y: Any, groups: Any) -> dict[str, Any]:
    """The effect of ``x`` on ``y`` within groups: each group's least-squares slope of ``y`` on ``x``, and their
    mean with its standard error (the slopes' standard deviation / √groups) and ``t`` (mean / standard error).

    A group is one condition drawn at several values of ``x`` with everything else held (a counterfactual: the same
    mask and noise), so what varies between its members is ``x`` alone and the differences between groups cancel.
    ``n`` is the number of groups; ``per_group`` their slopes.

    Raises:
        ValueError: as :func:`group_slopes`.
    """
    return slopes_effect(group_slopes(x, y, groups))


def slopes_effect(k: torch.Tensor) -> dict[str, Any]:
    """:func:`paired_effect` of the groups' slopes ``k`` ``(groups,)`` (:func:`group_slopes`)."""
    slopes = k.tolist()
    se = float(k.std() / math.sqrt(len(k))) if len(k) > 1 else math.nan
    mean = float(k.mean())
    return {"value": mean, "se": se, "t": mean / se if se and se > 0 else math.nan, "n": len(k),
            "per_group": [round(v, 6) for v in slopes]}


#: ridge penalties a probe chooses from (on standardised features), by its leave-one-out error
PROBE_ALPHAS = (1e-2, 1e-1, 1.0, 10.0, 100.0, 1e3, 1e4)


@dataclass(frozen=True)
class LinearProbe:
    """A ridge regression from feature vectors to a covariate, fitted on real volumes (:func:`fit_probe`):
    ``probe(features (N, F)) -> (N,)`` float64. ``loo_r`` is Pearson's r between the real values and their
    leave-one-out predictions: what the probe can read from a real volume, the ceiling of its figure on generated
    ones."""

    mean: torch.Tensor  # (F,) of the real features
    scale: torch.Tensor  # (F,), 0 where a feature is constant over the real volumes (it is then not used)
    weights: torch.Tensor  # (F,) on the standardised features
    intercept: float
    alpha: float
    loo_r: float
    n: int
    loo: tuple[float, ...]  # (N,) each real volume's prediction by the probe fitted without it

    def __call__(self, features: torch.Tensor) -> torch.Tensor:
        used = self.scale > 0
        x = (features.double()[:, used] - self.mean[used]) / self.scale[used]
        return x @ self.weights[used] + self.intercept


def fit_probe(features: torch.Tensor, targets: Any, alphas: Sequence[float] = PROBE_ALPHAS) -> LinearProbe:
    """Ridge regression of ``targets (N,)`` on ``features (N, F)`` (float64, each feature standardised over the N;
    the intercept unpenalised), its penalty the one of ``alphas`` with the least leave-one-out squared error, which
    ridge gives in closed form: ``e_i = (y − H y)_i / (1 − H_ii)`` with the hat matrix ``H = 11ᵀ/N + X (XᵀX + αI)⁻¹
    Xᵀ`` of the centred features (computed as ``K (K + αI)⁻¹``, ``K = XXᵀ``: N × N, for N ≪ F).

    Raises:
        ValueError: fewer than 3 volumes, a length mismatch, or every feature or every target constant.
    """
    x = features.double()
    y = torch.as_tensor(list(targets), dtype=torch.float64)
    n = x.shape[0]
    if n < 3 or y.numel() != n:
        raise ValueError(f"fit_probe needs >= 3 volumes with a target each, got {n} volumes and {y.numel()} targets")
    mean, scale = x.mean(0), x.std(0)
    scale = torch.where(scale > 1e-12, scale, torch.zeros_like(scale))
    if not bool((scale > 0).any()) or float(y.std()) == 0:
        raise ValueError("fit_probe: every feature (or every target) is constant over the volumes")
    used = scale > 0
    xc = (x[:, used] - mean[used]) / scale[used]
    yc = y - y.mean()
    k = xc @ xc.T
    eye = torch.eye(n, dtype=torch.float64)
    best = None
    for alpha in alphas:
        dual = torch.linalg.solve(k + alpha * eye, eye)  # (K + αI)⁻¹
        hat = k @ dual + 1.0 / n
        loo = (y - (hat @ yc + y.mean())) / (1.0 - torch.diagonal(hat))
        error = float(loo @ loo)
        if best is None or error < best[0]:
            best = (error, alpha, dual, y - loo)
    _, alpha, dual, predicted = best
    weights = torch.zeros(x.shape[1], dtype=torch.float64)
    weights[used] = xc.T @ (dual @ yc)
    return LinearProbe(mean=mean, scale=scale, weights=weights, intercept=float(y.mean()), alpha=alpha,
                       loo_r=pearson(y, predicted)["value"], n=n, loo=tuple(predicted.tolist()))


def describe(ms_ssim_settings: SSIMSettings = MS_SSIM_SETTINGS) -> dict[str, Any]:
    """The metric settings as plain data, for ``metrics.json``."""
    preset = next((k for k, v in MS_SSIM_PRESETS.items() if v == ms_ssim_settings), "custom")
    return {"ssim": SSIM_SETTINGS.as_dict(), "ms_ssim": {**ms_ssim_settings.as_dict(), "preset": preset},
            "ms_ssim_min_size": ms_ssim_settings.min_size}
