"""Confidence intervals of the evaluation's figures: a bootstrap over the volumes (SciPy's ``scipy.stats.bootstrap``).

A figure computed from N generated and R real volumes is one draw: other masks, another seed or more subjects move
it. Its interval says how far the volumes drawn alone move it: each set is resampled with replacement, N of N and R
of R, the generated and the real set apart (independent draws), a paired figure's sequences together (one set), and
the figure is recomputed from the per-volume quantities it is made of, so no metric runs again on a volume. The
resamples are seeded; the interval is SciPy's (``percentile`` by default; ``basic`` or ``BCa`` on request) and ``se``
is the standard deviation of the resampled figures.

Every statistic here is a function of index arrays ``(..., n)`` (one per set, a resample per leading index), so
SciPy resamples the indices and each figure is computed for a whole batch of resamples at once.

What is not bootstrapped, and why, is :data:`NOT_BOOTSTRAPPED`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from voxdiff.evaluation import metrics as M

#: SciPy's interval methods
METHODS = ("percentile", "basic", "BCa")
#: the fewest volumes in a set for an interval: below it most resamples repeat one or two volumes
MIN_VOLUMES = 5
#: the fewest resamples (other than 0, none): a 95% interval's tails are the 2.5% of the resamples at each end
MIN_RESAMPLES = 100
#: resamples computed at once (index arrays of this many rows per set)
BATCH = 200

#: the figures that carry no interval, and why (``metrics.json``: ``metric_settings.bootstrap``)
NOT_BOOTSTRAPPED = {
    "frechet_*": "a matrix square root per resample, and at small N its bias (it falls as N grows, Chong & Forsyth "
                 "2020) outweighs its spread: compare Fréchet distances at one N",
    "mmd_histogram": "the unbiased MMD² is no longer unbiased on a resample that repeats volumes",
    "*_effect_*": "carries its own standard error over masks (se, t)",
    "covariate_*_probe_real": "a leave-one-out r: each resample would refit the probe",
    "codebook_*": "a count over every latent of the split, not a mean over volumes",
}


@dataclass(frozen=True)
class Bootstrap:
    """How the intervals are drawn.

    Args:
        resamples: bootstrap resamples (0: no intervals; else at least :data:`MIN_RESAMPLES`).
        level: the confidence level, in (0, 1).
        method: one of :data:`METHODS` (SciPy's).
        seed: seeds the resamples.
    """

    resamples: int = 1000
    level: float = 0.95
    method: str = "percentile"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.resamples != 0 and self.resamples < MIN_RESAMPLES:
            raise ValueError(f"Bootstrap: resamples must be 0 or at least {MIN_RESAMPLES}, got {self.resamples}")
        if not 0 < self.level < 1:
            raise ValueError(f"Bootstrap: level must lie in (0, 1), got {self.level}")
        if self.method not in METHODS:
            raise ValueError(f"Bootstrap: method must be one of {METHODS}, got {self.method!r}")

    def describe(self) -> dict[str, Any]:
        """The settings, the smallest set given an interval and what is not bootstrapped, for ``metrics.json``."""
        return {**asdict(self), "min_volumes": MIN_VOLUMES, "over": "volumes; generated and real sets resampled apart",
                "not_bootstrapped": dict(NOT_BOOTSTRAPPED)}


def interval(statistic: Callable[..., torch.Tensor], sizes: Sequence[int], settings: Bootstrap | None
             ) -> dict[str, Any]:
    """The interval of ``statistic`` over resamples of sets of ``sizes`` volumes.

    Args:
        statistic: ``statistic(*indices)`` with one int64 tensor ``(..., sizes[k])`` per set (the volumes drawn,
            a resample per leading index) → the figure of each resample ``(...)``; on ``arange(sizes[k])`` each, it
            is the figure itself.
        sizes: volumes in each set (sets resampled independently).
        settings: None or ``resamples=0``: no interval.

    Returns:
        ``{"ci": [low, high], "ci_level": level, "se": standard error}``; ``{}`` without settings or where a set holds fewer than
        :data:`MIN_VOLUMES` volumes. A bound is NaN where resampled figures are (e.g. a ratio to a zero).
    """
    # deferred: SciPy's stats module costs a second to import; an evaluation without intervals never needs it
    from scipy.stats import bootstrap

    if settings is None or settings.resamples == 0 or min(sizes) < MIN_VOLUMES:
        return {}

    def vectorised(*indices: np.ndarray, axis: int = -1) -> np.ndarray:
        return statistic(*(torch.from_numpy(np.ascontiguousarray(ix)) for ix in indices)).numpy()

    with warnings.catch_warnings():  # a degenerate set (all volumes alike) warns; its interval is its value
        warnings.simplefilter("ignore")
        result = bootstrap(tuple(np.arange(n) for n in sizes), vectorised, n_resamples=settings.resamples,
                           batch=BATCH, vectorized=True, paired=False, axis=-1, confidence_level=settings.level,
                           method=settings.method, rng=np.random.default_rng(settings.seed))
    low, high = (float(b) for b in (result.confidence_interval.low, result.confidence_interval.high))
    return {"ci": [low, high], "ci_level": settings.level, "se": float(result.standard_error)}


# ------------------------------------------------------------------------------------------------ the figures
def mean_interval(values: torch.Tensor, settings: Bootstrap | None) -> dict[str, Any]:
    """The interval of the mean of per-volume figures ``(N,)`` (paired SSIM, PSNR, MS-SSIM; ventricle counts)."""
    v = values.double().reshape(-1)
    return interval(lambda ix: v[ix].mean(-1), [len(v)], settings)


def ratio_interval(generated: torch.Tensor, real: torch.Tensor, settings: Bootstrap | None) -> dict[str, Any]:
    """The interval of mean(generated) / mean(real) of per-volume figures ``(N,)`` and ``(R,)`` (sharpness)."""
    g, r = generated.double(), real.double()
    return interval(lambda ig, ir: g[ig].mean(-1) / r[ir].mean(-1), [len(g), len(r)], settings)


def tissue_distance_interval(generated: torch.Tensor, real: torch.Tensor, settings: Bootstrap | None
                             ) -> dict[str, Any]:
    """The interval of :func:`~voxdiff.evaluation.metrics.tissue_distance` of per-volume class shares ``(N, K)``
    and ``(R, K)``."""
    return interval(lambda ig, ir: M.tissue_distance(generated[ig], real[ir]), [len(generated), len(real)], settings)


def contrast_interval(sums: torch.Tensor, settings: Bootstrap | None) -> dict[str, Any]:
    """The interval of :func:`~voxdiff.evaluation.metrics.lesion_contrast` of per-volume intensity sums
    ``(N, 3, 3)`` (:func:`~voxdiff.evaluation.metrics.intensity_sums`)."""
    return interval(lambda ix: M.lesion_contrast(sums[ix]), [len(sums)], settings)


def resampled_diversity(pairs: M.Pairs, indices: torch.Tensor) -> torch.Tensor:
    """The mean pairwise MS-SSIM of resamples of a set: ``indices`` ``(..., n)`` (the volumes each resample drew) →
    ``(...)``. Each computed pair ``(i, j)`` weighs how often the resample drew ``i`` times how often it drew ``j``:
    the mean over the resample's pairs of distinct volumes (over those of them computed, where pairs were drawn);
    on ``arange(n)``, :meth:`~voxdiff.evaluation.metrics.Pairs.summary`'s value. NaN for a resample that holds no
    computed pair."""
    flat = indices.reshape(-1, indices.shape[-1])
    counts = torch.zeros(flat.shape[0], pairs.n, dtype=torch.float64)
    counts.scatter_add_(1, flat, torch.ones_like(flat, dtype=torch.float64))
    weights = counts[:, pairs.i] * counts[:, pairs.j]  # (resamples, pairs)
    return ((weights @ pairs.values.double()) / weights.sum(-1)).reshape(indices.shape[:-1])


def diversity_interval(pairs: M.Pairs, settings: Bootstrap | None) -> dict[str, Any]:
    """The interval of a set's diversity figure (:func:`resampled_diversity`)."""
    return interval(lambda ix: resampled_diversity(pairs, ix), [pairs.n], settings)


def correlation_interval(x: Sequence[float], y: Sequence[float], settings: Bootstrap | None) -> dict[str, Any]:
    """The interval of Pearson's r of paired sequences (:func:`~voxdiff.evaluation.metrics.correlation`)."""
    a, b = torch.as_tensor(list(x), dtype=torch.float64), torch.as_tensor(list(y), dtype=torch.float64)
    return interval(lambda ix: M.correlation(a[ix], b[ix]), [len(a)], settings)
