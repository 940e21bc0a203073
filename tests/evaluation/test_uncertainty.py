"""The figures' bootstrap intervals: each resampled statistic is its figure on the resampled volumes, the interval
covers a known mean as often as its level says, and sets too small, or no settings, give none."""

import itertools
import math

import numpy as np
import pytest
import torch

from voxdiff.evaluation import metrics as M
from voxdiff.evaluation import uncertainty as U

BOOT = U.Bootstrap(resamples=1000, seed=0)


def _mean(values, settings=BOOT):
    """The interval of the mean of ``values``, a set of generated volumes' figures."""
    return U.interval(U.mean_of(values), {"generated": len(values)}, settings)


def _one(resampler, n, settings=BOOT):
    return U.interval(resampler, {"generated": n, "real": n}, settings)


@pytest.mark.parametrize("kwargs", [{"resamples": 50}, {"resamples": -1}, {"level": 1.0}, {"level": 0.0},
                                    {"method": "studentized"}])
def test_settings_outside_their_range_are_refused(kwargs):
    with pytest.raises(ValueError):
        U.Bootstrap(**kwargs)


def test_the_interval_of_a_mean_has_the_width_and_standard_error_of_its_distribution():
    values = torch.from_numpy(np.random.default_rng(1).normal(3.0, 2.0, size=400))
    out = _mean(values, BOOT)
    assert out["ci_level"] == 0.95
    assert out["se"] == pytest.approx(2.0 / math.sqrt(400), rel=0.15)  # σ / √N
    low, high = out["ci"]
    assert low < float(values.mean()) < high
    assert high - low == pytest.approx(2 * 1.96 * 2.0 / math.sqrt(400), rel=0.15)


@pytest.mark.parametrize("method", U.METHODS)
def test_the_interval_covers_the_true_mean_about_as_often_as_its_level_says(method):
    rng = np.random.default_rng(2)
    settings = U.Bootstrap(resamples=400, method=method)
    trials = 200
    covered = 0
    for t in range(trials):
        values = torch.from_numpy(rng.exponential(1.0, size=40))  # skewed, true mean 1
        low, high = _mean(values, U.Bootstrap(settings.resamples, settings.level, method, seed=t))["ci"]
        covered += low <= 1.0 <= high
    assert 0.85 <= covered / trials <= 0.99  # 95% nominal; a bootstrap on 40 skewed values runs a little short


def test_the_same_seed_gives_the_same_interval_and_another_seed_another():
    values = torch.from_numpy(np.random.default_rng(3).normal(size=30))
    assert _mean(values, BOOT) == _mean(values, U.Bootstrap(seed=0))
    assert _mean(values, BOOT)["ci"] != _mean(values, U.Bootstrap(seed=1))["ci"]


def test_no_settings_no_resamples_or_too_few_volumes_give_no_interval():
    values = torch.arange(10.0)
    assert _mean(values, None) == {}
    assert _mean(values, U.Bootstrap(resamples=0)) == {}
    assert _mean(values[: U.MIN_VOLUMES - 1], BOOT) == {}
    small = {"generated": 10, "real": U.MIN_VOLUMES - 1}
    assert U.interval(U.ratio_of(values, values[: U.MIN_VOLUMES - 1]), small, BOOT) == {}  # one small set is enough
    assert "ci" in U.interval(U.mean_of(values), small, BOOT)  # a figure of the generated set alone
    assert "ci" in _mean(values[: U.MIN_VOLUMES], BOOT)


def test_a_set_of_identical_values_has_a_zero_width_interval():
    out = _mean(torch.full((12,), 0.7, dtype=torch.float64), BOOT)
    assert out["ci"] == pytest.approx([0.7, 0.7]) and out["se"] == pytest.approx(0.0)


def _pairs(n, max_pairs=None, seed=0):
    """A set's Pairs with known MS-SSIM values: pair (i, j) scores (i + 1) * (j + 1) / 100."""
    total = n * (n - 1) // 2
    picks = (torch.randperm(total, generator=torch.Generator().manual_seed(seed))[:max_pairs].sort().values
             if max_pairs else torch.arange(total))
    i, j = M.pair_indices(n, picks)
    return M.Pairs(i, j, ((i + 1) * (j + 1)).double() / 100, n, total, max_pairs is not None)


@pytest.mark.parametrize("max_pairs", [None, 12])
def test_a_resampled_diversity_is_the_mean_over_the_resamples_pairs_of_distinct_volumes(max_pairs):
    pairs = _pairs(8, max_pairs)
    value = {(int(a), int(b)): float(v) for a, b, v in zip(pairs.i, pairs.j, pairs.values)}
    assert float(U.resampled_diversity(pairs, torch.arange(8))) == pytest.approx(pairs.summary()["value"])
    draws = torch.from_numpy(np.random.default_rng(4).integers(0, 8, size=(5, 8)))
    got = U.resampled_diversity(pairs, draws)
    assert got.shape == (5,)
    for row, g in zip(draws.tolist(), got.tolist()):  # every pair of positions holding two distinct volumes
        seen = [value[min(a, b), max(a, b)] for a, b in itertools.combinations(row, 2)
                if a != b and (min(a, b), max(a, b)) in value]
        assert g == pytest.approx(sum(seen) / len(seen)) if seen else math.isnan(g)


def test_a_diverse_set_s_interval_is_wider_when_one_volume_stands_apart():
    n = 10
    alike = M.Pairs(*M.pair_indices(n, torch.arange(45)), torch.full((45,), 0.8, dtype=torch.float64), n, 45, False)
    i, j = alike.i, alike.j
    odd = M.Pairs(i, j, torch.where((i == 0) | (j == 0), 0.1, 0.8).double(), n, 45, False)
    assert _one(U.diversity_of(alike), n)["ci"] == pytest.approx([0.8, 0.8])
    low, high = _one(U.diversity_of(odd), n)["ci"]
    assert low < odd.summary()["value"] < high and high - low > 0.05


def test_the_lesion_contrast_s_interval_is_of_the_pooled_contrast_and_holds_it():
    gen = torch.Generator().manual_seed(5)
    images = torch.rand(12, 1, 8, 8, 8, generator=gen, dtype=torch.float64) * 0.5
    masks = torch.zeros_like(images)
    masks[:, :, 3:5, 3:5, 3:5] = 1
    images = images + masks * torch.linspace(0.1, 0.5, 12, dtype=torch.float64).view(-1, 1, 1, 1, 1)
    sums = M.intensity_sums(images, masks)
    assert sums.shape == (12, 3, 3)
    stats = M.intensity_stats(images, masks)
    assert float(M.lesion_contrast(sums)) == pytest.approx(stats["contrast"])
    assert stats["contrast"] == pytest.approx(float(images[masks > 0.5].mean() - images[M.lesion_shell(masks)].mean()))
    low, high = _one(U.contrast_of(sums), 12)["ci"]
    assert low < stats["contrast"] < high
    assert 0.1 < low and high < 0.5  # the lesions' contrasts run from 0.1 to 0.5


def test_the_sharpness_and_tissue_intervals_resample_the_generated_and_real_sets_apart():
    rng = np.random.default_rng(6)
    generated, real = torch.from_numpy(rng.normal(2.0, 0.2, 20)), torch.from_numpy(rng.normal(1.0, 0.2, 10))
    out = U.interval(U.ratio_of(generated, real), {"generated": 20, "real": 10}, BOOT)
    assert out["ci"][0] < float(generated.mean() / real.mean()) < out["ci"][1]
    fractions = torch.from_numpy(rng.dirichlet([5, 5, 5, 5], size=30))
    shifted = torch.from_numpy(rng.dirichlet([10, 5, 5, 1], size=30))
    value = float(M.tissue_distance(shifted, fractions))
    assert value == pytest.approx(0.5 * float((shifted.mean(0) - fractions.mean(0)).abs().sum()))
    low, high = _one(U.tissue_distance_of(shifted, fractions), 30)["ci"]
    assert low < value < high  # far apart: the distance is not at its floor of 0


def test_the_correlation_is_pearson_s_r_on_every_row_and_its_interval_holds_it():
    rng = np.random.default_rng(7)
    x = rng.normal(size=50)
    y = 0.6 * x + rng.normal(size=50)
    assert float(M.correlation(torch.from_numpy(x), torch.from_numpy(y))) == pytest.approx(np.corrcoef(x, y)[0, 1])
    rows = torch.from_numpy(np.stack([x, y, -x]))
    assert M.correlation(rows, torch.from_numpy(y).expand(3, -1)).tolist() == pytest.approx(
        [np.corrcoef(x, y)[0, 1], 1.0, -np.corrcoef(x, y)[0, 1]])
    assert math.isnan(M.pearson([1, 1, 1], [1, 2, 3])["value"])
    low, high = _one(U.correlation_of(x, y), 50)["ci"]
    assert low < np.corrcoef(x, y)[0, 1] < high and low > 0


def test_an_effect_is_resampled_over_its_masks_and_a_slope_over_its_subjects():
    """A counterfactual effect is the mean of each mask's slope: resampled over the masks (each mask's draws kept
    together), and the real subjects' slope over the subjects; on every mask and subject, each is its figure."""
    rng = np.random.default_rng(8)
    ages = [50.0, 60.0, 70.0] * 6
    groups = [i // 3 for i in range(18)]  # 6 masks, each drawn at the three ages
    ventricles = [0.8 * a + 5 * g + rng.normal(0, 1) for a, g in zip(ages, groups)]
    effect = M.paired_effect(ages, ventricles, groups)
    slopes = M.group_slopes(ages, ventricles, groups)
    assert slopes.shape == (6,) and float(slopes.mean()) == pytest.approx(effect["value"])
    resampler = U.mean_of(slopes, "masks")
    assert resampler.sets == ("masks",)
    out = U.interval(resampler, {"masks": 6}, BOOT)
    assert out["ci"][0] < effect["value"] < out["ci"][1] and 0.6 < out["ci"][0] and out["ci"][1] < 1.0
    x = rng.uniform(20, 90, 30)
    y = 0.5 * x + rng.normal(0, 3, 30)
    assert float(M.least_squares_slope(torch.from_numpy(x), torch.from_numpy(y))) == pytest.approx(
        M.slope(x, y)["value"])
    low, high = U.interval(U.slope_of(x, y), {"real": 30}, BOOT)["ci"]
    assert low < M.slope(x, y)["value"] < high


def test_a_share_is_the_ratio_of_the_resample_s_sums_and_a_present_mean_leaves_nan_out():
    """``share_of``: the parts over the wholes, each summed over the volumes drawn (a volume drawn twice counts twice;
    NaN where the wholes sum to 0); ``present_mean_of``: the mean of the values drawn that are not NaN."""
    parts, wholes = torch.tensor([1.0, 0.0, 3.0]), torch.tensor([2.0, 0.0, 4.0])
    share = U.share_of(parts, wholes)
    assert share.sets == ("generated",)
    drawn = torch.tensor([[0, 1, 2], [2, 2, 0], [1, 1, 1]])
    assert share.statistic(drawn)[:2].tolist() == pytest.approx([4 / 6, 7 / 10]) and share.statistic(drawn)[2].isnan()
    values = torch.tensor([0.2, math.nan, 0.6])
    mean = U.present_mean_of(values, "real").statistic(drawn)
    assert mean[:2].tolist() == pytest.approx([0.4, (0.6 + 0.6 + 0.2) / 3]) and mean[2].isnan()


def test_an_expanded_interval_says_how_few_resamples_lie_beyond_its_bounds_and_how_many_steady_them():
    """8 volumes, 1000 resamples: the expanded 95% interval is drawn at about 98.9%, so each bound has about 5.7
    resamples beyond it, which ``thin_tails`` names with the resamples that give 20 (4000); unexpanded, 25 each;
    10000 resamples, expanded: 57, nothing to say."""
    values = torch.tensor([0.3, 0.5, 0.4, 0.8, 0.6, 0.2, 0.7, 0.45])
    expanded = _mean(values)
    assert expanded["ci_tail_resamples"] == pytest.approx(1000 * (1 - expanded["ci_drawn_at"]) / 2, abs=0.05)
    assert 4 < expanded["ci_tail_resamples"] < 8
    note = U.thin_tails([expanded["ci_tail_resamples"], 30.0], 1000)
    assert note.startswith("1 interval(s) rest on as few as") and "bootstrap.resamples=4000" in note
    assert _mean(values, U.Bootstrap(resamples=1000, expand=False))["ci_tail_resamples"] == 25.0
    steady = _mean(values, U.Bootstrap(resamples=10000))["ci_tail_resamples"]
    assert steady > 20 and U.thin_tails([steady], 10000) is None


def test_beyond_counts_the_generated_values_above_every_real_one_drawn():
    """``beyond_of``: the share of the generated values drawn (NaN ones left out) above the greatest real value
    drawn; a resample that leaves out the greatest real value lowers the bar."""
    generated, real = torch.tensor([0.9, 0.5, math.nan, 0.7]), torch.tensor([0.6, 0.8])
    beyond = U.beyond_of(generated, real)
    assert beyond.sets == ("generated", "real")
    everything = beyond.statistic(torch.arange(4), torch.arange(2))
    assert float(everything) == pytest.approx(1 / 3)  # 0.9 of 0.9, 0.5, 0.7: above 0.8
    assert float(beyond.statistic(torch.arange(4), torch.tensor([0, 0]))) == pytest.approx(2 / 3)  # above 0.6


@pytest.mark.parametrize("method", ["percentile", "basic"])
def test_resamples_without_a_figure_are_counted_and_left_out_of_the_interval(method):
    """r(sex, head size) over 8 subjects, 2 of one sex: about 1 resample in 10 draws one sex only, where r is
    undefined. Those are counted and left out; the interval is the others' (as SciPy's, were they dropped)."""
    sex = [0, 0, 0, 0, 0, 0, 1, 1]
    head = [10.0, 11.0, 9.5, 10.2, 10.8, 9.9, 12.0, 12.5]
    out = U.interval(U.correlation_of(sex, head), {"generated": 8}, U.Bootstrap(method=method))
    assert 20 < out["undefined_resamples"] < 300
    low, high = out["ci"]
    assert math.isfinite(low) and math.isfinite(high) and math.isfinite(out["se"])
    r = M.pearson(sex, head)["value"]
    assert low < r < high  # basic: 2r minus the percentile bounds, which hold r here too


def test_a_recipe_s_figure_is_its_runs_mean_and_a_resample_draws_runs_and_volumes_together():
    """``runs_of``: on every volume and run once, the mean of the runs' figures; on a resample, the mean over the
    runs it drew (with repeats) of each run's figure on the volumes it drew, the same volumes in every run; a
    member over two sets (a ratio to the real set) takes the real resample too."""
    rng = np.random.default_rng(5)
    per_run = [torch.from_numpy(rng.normal(k, 1.0, 7)) for k in range(3)]
    real = torch.from_numpy(rng.uniform(1.0, 2.0, 6))
    recipe = U.runs_of([U.mean_of(v) for v in per_run], "runs_1")
    assert recipe.sets == ("generated", "runs_1")
    whole = {"generated": torch.arange(7), "runs_1": torch.arange(3)}
    assert float(recipe(whole)) == pytest.approx(float(torch.stack([v.mean() for v in per_run]).mean()))
    volumes = torch.tensor([[0, 0, 1, 2, 3, 3, 6], [5, 5, 5, 4, 4, 1, 0]])
    drawn = torch.tensor([[2, 2, 0], [1, 1, 1]])
    got = recipe({"generated": volumes, "runs_1": drawn})
    for b in range(2):
        want = sum(float(per_run[int(k)][volumes[b]].mean()) for k in drawn[b]) / 3
        assert float(got[b]) == pytest.approx(want)
    ratio = U.runs_of([U.ratio_of(v.abs() + 1, real) for v in per_run], "runs_2")
    assert ratio.sets == ("generated", "real", "runs_2")
    real_drawn = torch.tensor([[1, 1, 2, 3, 4, 5], [0, 0, 0, 0, 0, 0]])
    got = ratio({"generated": volumes, "real": real_drawn, "runs_2": drawn})
    for b in range(2):
        want = sum(float((per_run[int(k)][volumes[b]].abs() + 1).mean() / real[real_drawn[b]].mean())
                   for k in drawn[b]) / 3
        assert float(got[b]) == pytest.approx(want)
    with pytest.raises(ValueError):
        U.runs_of([], "runs_1")


def test_a_recipe_s_interval_holds_the_spread_of_its_runs_and_needs_five_of_them():
    """Six runs of one recipe whose figures differ by a run offset (spread 1) far more than their volumes do
    (spread 0.1): the recipe's interval is that of the offsets' mean (standard error about σ/√6, shrunk by the
    bootstrap's √(5/6)), many times one run's interval over its volumes; with 4 runs, no interval (as a set of 4
    volumes has none)."""
    rng = np.random.default_rng(6)
    x = rng.normal(0.0, 0.1, 20)
    offsets = rng.normal(0.0, 1.0, 6)
    members = [U.mean_of(torch.from_numpy(x + o)) for o in offsets]
    out = U.interval(U.runs_of(members, "runs_1"), {"generated": 20, "runs_1": 6}, BOOT)
    mean = float(np.mean(x) + offsets.mean())
    assert out["ci"][0] < mean < out["ci"][1]
    assert out["se"] == pytest.approx(offsets.std(ddof=1) / math.sqrt(6) * math.sqrt(5 / 6), rel=0.2)
    one = _mean(torch.from_numpy(x + offsets[0]))
    assert out["ci"][1] - out["ci"][0] > 10 * (one["ci"][1] - one["ci"][0])
    assert U.interval(U.runs_of(members[:4], "runs_1"), {"generated": 20, "runs_1": 4}, BOOT) == {}


@pytest.mark.parametrize("expand", [False, True])
def test_a_recipe_s_interval_covers_its_mean_as_often_as_its_level_only_when_expanded(expand):
    """What the README says of a recipe's 95% interval when its runs' spread dominates (run offsets N(0, 1), the
    volumes' spread 0.1 about a fixed mean): SciPy's bootstrap over 5 runs is too narrow (it spreads by √(4/5) of the
    runs' spread and by normal, not t, quantiles), covering the mean in about 85% of draws, with 10 runs about 91%;
    expanded (the default), the runs' share of the variance sets the degrees of freedom and both cover about 95%."""
    def coverage(k: int, trials: int = 300) -> float:
        hits = 0
        for t in range(trials):
            rng = np.random.default_rng(1000 + t)
            x = rng.normal(0.0, 0.1, 8)
            members = [U.mean_of(torch.from_numpy(x - x.mean() + o)) for o in rng.normal(0.0, 1.0, k)]
            low, high = U.interval(U.runs_of(members, "runs_1"), {"generated": 8, "runs_1": k},
                                   U.Bootstrap(resamples=1000, seed=t, expand=expand))["ci"]
            hits += low <= 0.0 <= high
        return hits / trials

    five, ten = coverage(5), coverage(10)
    if expand:
        assert 0.91 <= five <= 0.99 and 0.91 <= ten <= 0.99
    else:
        assert 0.78 <= five <= 0.90 and 0.86 <= ten <= 0.95 and ten > five


@pytest.mark.parametrize("expand", [False, True])
def test_an_interval_of_eight_volumes_covers_as_often_as_its_level_only_when_expanded(expand):
    """A percentile interval of the mean of 8 normal volumes covers about 91% unexpanded (√(7/8) and z for t(7));
    expanded by 1.29 about 95%."""
    hits, trials = 0, 400
    for t in range(trials):
        values = torch.from_numpy(np.random.default_rng(5000 + t).normal(0.0, 1.0, 8))
        low, high = _mean(values, U.Bootstrap(resamples=1000, seed=t, expand=expand))["ci"]
        hits += low <= 0.0 <= high
    assert (0.92 <= hits / trials <= 0.99) if expand else (0.83 <= hits / trials <= 0.92)


def test_the_expansion_is_hesterberg_s_for_one_set_and_follows_the_set_that_spreads():
    from scipy.stats import norm, t

    z = norm.ppf(0.975)
    for n in (5, 8, 40):
        assert U.expansion({"generated": 2.0}, {"generated": n}, 0.95) == pytest.approx(
            math.sqrt(n / (n - 1)) * t.ppf(0.975, n - 1) / z)
    one = U.expansion({"generated": 1.0}, {"generated": 8, "runs_1": 5}, 0.95)
    assert U.expansion({"generated": 1.0, "runs_1": 0.0}, {"generated": 8, "runs_1": 5}, 0.95) == pytest.approx(one)
    runs = U.expansion({"runs_1": 1.0}, {"generated": 8, "runs_1": 5}, 0.95)
    mixed = U.expansion({"generated": 1e-4, "runs_1": 1.0}, {"generated": 8, "runs_1": 5}, 0.95)
    assert runs > one and mixed == pytest.approx(runs, rel=1e-3)
    # two like sets of 8 pool their degrees of freedom: wider than 40 volumes, narrower than 8
    both = U.expansion({"generated": 1.0, "real": 1.0}, {"generated": 8, "real": 8}, 0.95)
    assert U.expansion({"g": 1.0}, {"g": 40}, 0.95) < both < one
    assert U.expansion({"generated": 0.0}, {"generated": 8}, 0.95) == 1.0


def test_each_set_s_share_of_a_crossed_mean_s_variance_adds_up_to_the_whole():
    """Runs offset N(0, 1) crossed with 20 volumes N(0, 0.5): resampling the runs alone spreads the mean by the
    runs' plug-in variance over 6, the volumes alone by theirs over 20, and the two add up to the bootstrap's."""
    rng = np.random.default_rng(9)
    x, offsets = rng.normal(0.0, 0.5, 20), rng.normal(0.0, 1.0, 6)
    members = [U.mean_of(torch.from_numpy(x + o)) for o in offsets]
    figure = U.runs_of(members, "runs_1")
    sizes = {"generated": 20, "runs_1": 6}
    shares = U.component_variances(figure, sizes, U.Bootstrap(resamples=2000, seed=1))
    assert shares["runs_1"] == pytest.approx(offsets.var() / 6, rel=0.15)
    assert shares["generated"] == pytest.approx(x.var() / 20, rel=0.15)
    whole = U.interval(figure, sizes, U.Bootstrap(resamples=2000, seed=1, expand=False))["se"] ** 2
    assert sum(shares.values()) == pytest.approx(whole, rel=0.15)
    out = U.interval(figure, sizes, U.Bootstrap(resamples=2000, seed=1))
    plain = U.interval(figure, sizes, U.Bootstrap(resamples=2000, seed=1, expand=False))
    assert out["ci_expanded_by"] == pytest.approx(U.expansion(shares, sizes, 0.95))
    assert out["ci_drawn_at"] == pytest.approx(U.drawn_level(0.95, out["ci_expanded_by"])) and out["ci_level"] == 0.95
    assert out["se"] == plain["se"]  # the standard error is the bootstrap's; only the interval widens
    # the same resamples' quantiles at the wider level: SciPy's interval there, within the resampled range
    wider = U.interval(figure, sizes, U.Bootstrap(resamples=2000, seed=1, level=out["ci_drawn_at"], expand=False))
    assert out["ci"] == wider["ci"] and out["ci"][0] < plain["ci"][0] and out["ci"][1] > plain["ci"][1]


def test_an_expanded_interval_stays_within_what_the_figure_can_take():
    """A correlation's interval over 6 volumes, expanded by 1.44, keeps to [-1, 1] (its quantiles are drawn at a
    wider level, not stretched past the resampled figures)."""
    x = [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    y = [0.1, 1.0, 2.2, 2.9, 4.1, 5.0]  # r = 0.997
    out = U.interval(U.correlation_of(x, y), {"generated": 6}, BOOT)
    assert out["ci_expanded_by"] == pytest.approx(U.expansion({"generated": 1.0}, {"generated": 6}, 0.95))
    assert -1.0 <= out["ci"][0] < out["ci"][1] <= 1.0 + 1e-12  # widened about its centre: 1.0016
