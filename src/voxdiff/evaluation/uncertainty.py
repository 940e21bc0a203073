"""Confidence intervals of the evaluation's figures: a bootstrap over the volumes (SciPy's ``scipy.stats.bootstrap``).

A figure computed from N generated and R real volumes is one draw: other masks, another seed or more subjects move
it. Its interval says how far the volumes drawn alone move it: each set is resampled with replacement, N of N and R
of R, the generated and the real set apart (independent draws), a paired figure's sequences together (one set), and
the figure is recomputed from the per-volume quantities it is made of, so no metric runs again on a volume. The
resamples are seeded; the interval is SciPy's (``percentile`` by default; ``basic`` or ``BCa`` on request) and ``se``
is the standard deviation of the resampled figures.

A bootstrap of few volumes (or few training runs) is too narrow: it spreads by ``sqrt((n - 1) / n)`` of the spread
and its tails are normal, not Student's t (a 95% percentile interval of 8 volumes covers about 91%, one over 5
runs about 86%). By default each interval is drawn at the wider level that makes up both (the expanded percentile
bootstrap, Hesterberg 2015, Am. Stat. 69(4): a 95% interval of 8 volumes is the 0.6% and 99.4% quantiles of the
resampled figures), so it stays within what the figure can take; where a figure is drawn from several sets
(generated and real volumes, training runs) the degrees of freedom are Welch–Satterthwaite's over each set's share
of the variance, its own bootstrap with the others held (:func:`expansion`). The tails of an expanded interval of
few volumes are a few resamples each: more resamples steady them.

Every figure here is a :class:`Resampler`: a function of index arrays ``(..., n)`` (one per set, a resample per
leading index), so SciPy resamples the indices and each figure is computed for a whole batch of resamples at once;
the same function compares two evaluations drawn with the same masks and noise on the same resamples
(:func:`paired_interval`, a guidance sweep's ties).

What is not bootstrapped, and why, is :data:`NOT_BOOTSTRAPPED`.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
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
#: the fewest resamples beyond each bound for a steady interval (:func:`thin_tails`)
MIN_TAIL = 20

#: the figures that carry no interval, and why (``metrics.json``: ``metric_settings.bootstrap``)
NOT_BOOTSTRAPPED = {
    "frechet_*": "a matrix square root per resample, and at small N its bias (it falls as N grows, Chong & Forsyth "
                 "2020) outweighs its spread: compare Fréchet distances at one N",
    "mmd_histogram": "the unbiased MMD² is no longer unbiased on a resample that repeats volumes",
    "*_effect_control_data": "the control's training pairs: a set this evaluation does not draw",
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
        expand: widen each interval for the sizes of its sets (:func:`expansion`); False: SciPy's interval as it
            is, narrower than its level with few volumes or runs.
    """

    resamples: int = 1000
    level: float = 0.95
    method: str = "percentile"
    seed: int = 0
    expand: bool = True

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
                "not_bootstrapped": dict(NOT_BOOTSTRAPPED),
                **({"expanded": EXPANDED} if self.expand else {})}


#: what ``expand`` does to an interval, for ``metrics.json``
EXPANDED = ("each interval drawn at the level 2 * Phi(f * z) - 1 (ci_drawn_at) for its nominal level's z, f = t(df) "
            "* sqrt(sum a_s) / (z * sqrt(sum v_s)) (ci_expanded_by), v_s the variance of the figure when set s alone "
            "is resampled, a_s = v_s * n_s / (n_s - 1), df Welch-Satterthwaite's; one set: the expanded percentile "
            "bootstrap (Hesterberg 2015)")


#: the sets a figure is computed from: the generated volumes (and anything drawn with the same masks and noise,
#: such as a negative control's) and the real ones; each is resampled apart (and, for the counterfactual effects,
#: the masks each drawn at every value of a covariate, ``"masks"``)
SETS = ("generated", "real")


@dataclass(frozen=True)
class Resampler:
    """A figure as a function of the volumes drawn.

    ``statistic(*indices)`` takes one int64 tensor ``(..., n)`` per set of ``sets`` (in that order: the volumes each
    resample drew from the set, a resample per leading index) and returns the figure of each resample ``(...)``; on
    ``arange(n)`` for each set it is the figure itself. Two evaluations drawn with the same masks and noise (a
    guidance sweep) share the indices of their generated volumes: volume ``i`` of one is the twin of volume ``i``
    of the other (:func:`paired_interval`).
    """

    statistic: Callable[..., torch.Tensor]
    sets: tuple[str, ...]

    def __call__(self, indices: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return self.statistic(*(indices[s] for s in self.sets))


def bootstrap_indices(function: Callable[[dict[str, torch.Tensor]], torch.Tensor], sizes: Mapping[str, int],
                      settings: Bootstrap | None) -> dict[str, Any]:
    """The interval of ``function`` over resamples of the sets ``sizes`` names (``{set: volumes}``), each resampled
    apart: ``function({set: indices (..., n)})`` → ``(...)``.

    Returns:
        ``{"ci": [low, high], "ci_level": level, "se": standard error}`` (``se``: the resampled figures' standard
        deviation, as SciPy gives it; with ``settings.expand`` the interval is drawn at the wider level
        ``ci_drawn_at`` that :func:`expansion`'s factor ``ci_expanded_by`` gives); ``{}`` without settings or where
        a set holds fewer than :data:`MIN_VOLUMES` volumes. Resamples whose figure is undefined (NaN: a
        correlation over resampled values of one level, a ratio to 0) are counted in ``undefined_resamples`` and
        left out of a percentile or basic interval and of ``se``; a BCa interval is NaN then, as SciPy computes it.
    """
    # deferred: SciPy's stats module costs half a second to import; an evaluation without intervals never needs it
    from scipy.stats import bootstrap

    if settings is None or settings.resamples == 0 or min(sizes.values()) < MIN_VOLUMES:
        return {}
    names = list(sizes)
    level, widened = settings.level, {}
    if settings.expand:  # one set's factor needs no variance: it is the same for any
        factor = expansion(component_variances(function, sizes, settings) if len(names) > 1 else {names[0]: 1.0},
                           sizes, settings.level)
        level = drawn_level(settings.level, factor)
        widened = {"ci_expanded_by": factor, "ci_drawn_at": level}

    def vectorised(*indices: np.ndarray, axis: int = -1) -> np.ndarray:
        return function({k: torch.from_numpy(np.ascontiguousarray(ix)) for k, ix in zip(names, indices)}).numpy()

    with warnings.catch_warnings():  # a degenerate set (all volumes alike) warns; its interval is its value
        warnings.simplefilter("ignore")
        result = bootstrap(tuple(np.arange(sizes[k]) for k in names), vectorised, n_resamples=settings.resamples,
                           batch=BATCH, vectorized=True, paired=False, axis=-1, confidence_level=level,
                           method=settings.method, rng=np.random.default_rng(settings.seed))
    low, high = (float(b) for b in (result.confidence_interval.low, result.confidence_interval.high))
    se = float(result.standard_error)
    distribution = np.asarray(result.bootstrap_distribution, dtype=np.float64)
    undefined = int(np.isnan(distribution).sum())
    if undefined and undefined < len(distribution) and settings.method != "BCa":
        # a few resamples without a figure (a correlation over a resample whose values are all one level): the
        # interval of those that have one, and how many had none
        tails = np.nanpercentile(distribution, [50 * (1 - level), 50 * (1 + level)])
        low, high = (float(b) for b in (tails if settings.method == "percentile" else
                                        2 * float(function({k: torch.arange(sizes[k]) for k in names})) - tails[::-1]))
        se = float(np.nanstd(distribution, ddof=1))
    # each bound is a quantile with this many resamples beyond it: few at an expanded level of few volumes or runs
    tail = round(settings.resamples * (1 - level) / 2, 1)
    return {"ci": [low, high], "ci_level": settings.level, "se": se, **widened, "ci_tail_resamples": tail,
            **({"undefined_resamples": undefined} if undefined else {})}


def thin_tails(tails: Iterable[float], resamples: int) -> str | None:
    """What to say of intervals whose bounds rest on fewer than :data:`MIN_TAIL` resamples each (``tails``: their
    ``ci_tail_resamples``, drawn from ``resamples``), with the resamples that would give every one of them
    :data:`MIN_TAIL`; None where none is that thin."""
    thin = [t for t in tails if t < MIN_TAIL]
    if not thin:
        return None
    needed = math.ceil(MIN_TAIL * resamples / max(min(thin), 0.1) / 1000) * 1000
    return (f"{len(thin)} interval(s) rest on as few as {min(thin):g} resamples beyond a bound (an interval widened "
            f"for few volumes or runs is drawn far into the tails): bootstrap.resamples={needed} steadies them")


def component_variances(function: Callable[[dict[str, torch.Tensor]], torch.Tensor], sizes: Mapping[str, int],
                        settings: Bootstrap) -> dict[str, float]:
    """Each set's share of a figure's bootstrap variance: the variance of ``function`` over
    ``settings.resamples`` resamples of that set alone, every other set held as drawn (``arange``), each seeded from
    ``settings.seed`` and the set's place. For a mean over crossed sets (runs × volumes) these add up to the
    variance of resampling all at once, less the small term of both drawn together."""
    names = list(sizes)
    shares = {}
    for k, name in enumerate(names):
        rng = np.random.default_rng([settings.seed, k])
        drawn = []
        for start in range(0, settings.resamples, BATCH):
            rows = min(BATCH, settings.resamples - start)
            ix = {m: (torch.from_numpy(rng.integers(0, sizes[m], size=(rows, sizes[m]))) if m == name
                      else torch.arange(sizes[m]).expand(rows, sizes[m])) for m in names}
            drawn.append(function(ix).double().reshape(-1).numpy())
        values = np.concatenate(drawn)
        shares[name] = float(np.nanvar(values, ddof=1)) if np.isfinite(values).sum() > 1 else 0.0
    return shares


def drawn_level(level: float, factor: float) -> float:
    """The level whose normal quantile is ``factor`` times ``level``'s: ``2 * Phi(factor * z) - 1``; a percentile
    interval drawn at it is as much wider as a normal one would be (0.95 widened 1.29 is drawn at 0.9885)."""
    # deferred: SciPy's stats module costs half a second to import; an evaluation without intervals never needs it
    from scipy.stats import norm

    return float(2 * norm.cdf(factor * norm.ppf((1 + level) / 2)) - 1)


def expansion(variances: Mapping[str, float], sizes: Mapping[str, int], level: float) -> float:
    """How much wider a bootstrap interval is made for the sizes of the sets it resampled (:func:`drawn_level`).

    A set of ``n`` drawn with replacement spreads a figure by ``v_s``, ``(n - 1) / n`` of what a new draw of ``n``
    would (the plug-in variance), and a normal interval of an estimated spread is too narrow by Student's t. With
    ``a_s = v_s * n_s / (n_s - 1)`` the factor is ``t(level, df) * sqrt(sum a_s) / (z(level) * sqrt(sum v_s))``,
    ``df = (sum a_s)**2 / sum(a_s**2 / (n_s - 1))`` (Welch–Satterthwaite): the set whose spread dominates sets the
    degrees of freedom, and one set of ``n`` gives Hesterberg's expanded percentile, ``sqrt(n / (n - 1)) *
    t(n - 1) / z`` (1.58 at 5, 1.29 at 8, 1.05 at 40 for 95%). 1 where nothing spreads.

    Args:
        variances: ``{set: v_s}``, the figure's variance when that set alone is resampled.
        sizes: ``{set: n_s}``, each at least 2.
        level: the confidence level, in (0, 1).
    """
    # deferred: SciPy's stats module costs half a second to import; an evaluation without intervals never needs it
    from scipy.stats import norm, t

    spread = {k: max(0.0, v) for k, v in variances.items() if math.isfinite(v)}
    corrected = {k: v * sizes[k] / (sizes[k] - 1) for k, v in spread.items()}
    total, plain = sum(corrected.values()), sum(spread.values())
    if total <= 0:
        return 1.0
    df = total ** 2 / sum(a ** 2 / (sizes[k] - 1) for k, a in corrected.items())
    tail = (1 + level) / 2
    return float(t.ppf(tail, df) * math.sqrt(total) / (norm.ppf(tail) * math.sqrt(plain)))


def interval(resampler: Resampler, sizes: Mapping[str, int], settings: Bootstrap | None) -> dict[str, Any]:
    """The interval of one figure (:func:`bootstrap_indices` over the sets it is computed from)."""
    return bootstrap_indices(resampler, {k: sizes[k] for k in resampler.sets}, settings)


def paired_interval(a: Resampler, b: Resampler, sizes: Mapping[str, int], settings: Bootstrap | None,
                    score: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor],
                    goal: Resampler | None = None) -> dict[str, Any]:
    """The interval of ``score(a) - score(b)`` for one figure of two evaluations drawn with the same masks and noise:
    both are computed on the same resample (volume ``i`` of each set drawn in both), so what the two evaluations
    share cancels. ``score(value, target)`` ranks a figure (lower is better), ``goal`` is the figure's target drawn
    on the same resample (the real set's twin figure), or None."""
    sets = tuple(dict.fromkeys((*a.sets, *b.sets, *(goal.sets if goal else ()))))

    def difference(ix: dict[str, torch.Tensor]) -> torch.Tensor:
        target = None if goal is None else goal(ix)
        return score(a(ix), target) - score(b(ix), target)

    return bootstrap_indices(difference, {k: sizes[k] for k in sets}, settings)


def runs_of(members: Sequence[Resampler], runs: str) -> Resampler:
    """One figure of a recipe trained several times: the mean of its runs' figures (``members``, one per training
    run, each evaluated on the same masks, noise and real volumes), resampled over both: the runs (the set
    ``runs``, as many as ``members``: a resample draws runs with replacement) and, as every member is, the volumes
    (the same indices in every run: volume ``i`` is drawn from the same mask and noise by each). Runs and volumes
    are crossed, not nested, and resampled independently, as Owen's pigeonhole bootstrap does (Owen 2007, Ann.
    Appl. Stat.): the interval holds how far other training runs and other volumes could move the recipe's
    figure, and :func:`paired_interval` of two recipes' figures (each its own ``runs`` set, resampled apart)
    compares the recipes rather than two trained models. With fewer than :data:`MIN_VOLUMES` runs it has no
    interval, as a set of that few volumes has none; with few more SciPy's interval is narrower than its level says
    (a 95% interval over 5 runs covers about 85% of the time where the runs' spread dominates), which
    ``Bootstrap.expand`` makes up (:func:`expansion`: the runs' share of the variance sets its degrees of freedom;
    both tested)."""
    if not members:
        raise ValueError("runs_of: a recipe needs at least one run")
    sets = (*dict.fromkeys(s for m in members for s in m.sets), runs)

    def statistic(*indices: torch.Tensor) -> torch.Tensor:
        named = dict(zip(sets, indices, strict=True))
        each = torch.stack(torch.broadcast_tensors(*(m(named) for m in members)), -1)  # (..., runs)
        drawn = named[runs]  # (..., k): the runs each resample drew
        lead = torch.broadcast_shapes(each.shape[:-1], drawn.shape[:-1])
        return each.expand(*lead, each.shape[-1]).gather(-1, drawn.expand(*lead, drawn.shape[-1])).mean(-1)

    return Resampler(statistic, sets)


# ------------------------------------------------------------------------------------------------ the figures
def mean_of(values: torch.Tensor, of: str = "generated") -> Resampler:
    """The mean of per-volume figures ``(N,)`` of the set ``of`` (paired SSIM, PSNR, MS-SSIM; ventricle counts)."""
    v = values.double().reshape(-1)
    return Resampler(lambda ix: v[ix].mean(-1), (of,))


def present_mean_of(values: torch.Tensor, of: str = "generated") -> Resampler:
    """The mean of the per-volume figures ``(N,)`` of the set ``of`` that are not NaN (a nearest-training Dice: none
    for an empty mask); NaN for a resample that drew none."""
    v = values.double().reshape(-1)
    return Resampler(lambda ix: v[ix].nanmean(-1), (of,))


def share_of(parts: torch.Tensor, wholes: torch.Tensor, of: str = "generated") -> Resampler:
    """``sum(parts) / sum(wholes)`` of per-volume counts ``(N,)`` of the set ``of`` (lesion voxels outside the head
    of all lesion voxels); NaN for a resample whose wholes sum to 0."""
    p, w = parts.double().reshape(-1), wholes.double().reshape(-1)

    def statistic(ix: torch.Tensor) -> torch.Tensor:
        total = w[ix].sum(-1)
        return torch.where(total > 0, p[ix].sum(-1) / total.clamp(min=1e-300), torch.nan)

    return Resampler(statistic, (of,))


def beyond_of(generated: torch.Tensor, real: torch.Tensor) -> Resampler:
    """The share of the generated volumes' figures ``(N,)`` above the greatest of the real ones ``(R,)`` (NaN: none
    counted): generated volumes nearer to the training set than every held-out real volume."""
    g, r = generated.double(), real.double()

    def statistic(ig: torch.Tensor, ir: torch.Tensor) -> torch.Tensor:
        values, ceiling = g[ig], r[ir].nan_to_num(-torch.inf).amax(-1, keepdim=True)
        present = ~values.isnan()
        return (present & (values > ceiling)).sum(-1).double() / present.sum(-1)

    return Resampler(statistic, SETS)


def ratio_of(generated: torch.Tensor, real: torch.Tensor) -> Resampler:
    """mean(generated) / mean(real) of per-volume figures ``(N,)`` and ``(R,)`` (the sharpness)."""
    g, r = generated.double(), real.double()
    return Resampler(lambda ig, ir: g[ig].mean(-1) / r[ir].mean(-1), SETS)


def tissue_distance_of(generated: torch.Tensor, real: torch.Tensor) -> Resampler:
    """:func:`~voxdiff.evaluation.metrics.tissue_distance` of per-volume class shares ``(N, K)`` and ``(R, K)``."""
    return Resampler(lambda ig, ir: M.tissue_distance(generated[ig], real[ir]), SETS)


def contrast_of(sums: torch.Tensor, of: str = "generated") -> Resampler:
    """:func:`~voxdiff.evaluation.metrics.lesion_contrast` of per-volume intensity sums ``(N, 3, 3)``
    (:func:`~voxdiff.evaluation.metrics.intensity_sums`) of the set ``of``."""
    return Resampler(lambda ix: M.lesion_contrast(sums[ix]), (of,))


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


def diversity_of(pairs: M.Pairs, of: str = "generated") -> Resampler:
    """A set's diversity figure (:func:`resampled_diversity`)."""
    return Resampler(lambda ix: resampled_diversity(pairs, ix), (of,))


def slope_of(x: Sequence[float], y: Sequence[float], of: str = "real") -> Resampler:
    """The least-squares slope of ``y`` on ``x`` (:func:`~voxdiff.evaluation.metrics.least_squares_slope`) over the
    set ``of``."""
    a, b = torch.as_tensor(list(x), dtype=torch.float64), torch.as_tensor(list(y), dtype=torch.float64)
    return Resampler(lambda ix: M.least_squares_slope(a[ix], b[ix]), (of,))


def correlation_of(x: Sequence[float], y: Sequence[float], of: str = "generated") -> Resampler:
    """Pearson's r (:func:`~voxdiff.evaluation.metrics.correlation`) of paired sequences over the set ``of``."""
    a, b = torch.as_tensor(list(x), dtype=torch.float64), torch.as_tensor(list(y), dtype=torch.float64)
    return Resampler(lambda ix: M.correlation(a[ix], b[ix]), (of,))
