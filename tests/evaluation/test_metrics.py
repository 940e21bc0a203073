"""Every figure on a known case: identical volumes, independent noise, a set against itself, small N."""

import math

import pytest
import torch
from monai.metrics import FIDMetric
from voxdiff.errors import ConfigError
from voxdiff.evaluation import metrics as M

SHAPE = (1, 1, 24, 32, 32)


def _volumes(n, seed=0, shape=SHAPE[2:]):
    g = torch.Generator().manual_seed(seed)
    return torch.rand((n, 1, *shape), generator=g)


def test_identical_volumes_score_one_and_noise_scores_low():
    a, b = _volumes(3, 0), _volumes(3, 1)
    torch.testing.assert_close(M.ms_ssim(a, a), torch.ones(3, dtype=torch.float64))
    torch.testing.assert_close(M.ssim(a, a), torch.ones(3, dtype=torch.float64))
    assert M.ms_ssim(a, a).dtype == torch.float64
    assert (M.ms_ssim(a, b) < 0.2).all()  # independent uniform noise
    assert (M.ssim(a, b).abs() < 0.05).all()
    torch.testing.assert_close(M.psnr(a, (a + 0.1)), torch.full((3,), 20.0, dtype=torch.float64))


def test_pairwise_ms_ssim_counts_pairs_and_follows_diversity():
    same = _volumes(1, 0).expand(4, -1, -1, -1, -1)
    d = M.pairwise_ms_ssim(same)
    assert d["n"] == 4 and d["pairs"] == 6 and d["value"] == pytest.approx(1.0)
    assert M.pairwise_ms_ssim(_volumes(4, 2))["value"] < 0.2  # four independent noise volumes: diverse


def test_pair_indices_follow_combinations_order():
    import itertools

    for n in (2, 3, 7):
        i, j = M.pair_indices(n, torch.arange(n * (n - 1) // 2))
        assert list(zip(i.tolist(), j.tolist())) == list(itertools.combinations(range(n), 2))


def test_pairwise_ms_ssim_over_a_seeded_random_subset_of_pairs():
    """Above ``max_pairs`` the figure is the mean over that many distinct pairs drawn with the seed (the same pairs
    for the same seed, others for another), exactly the mean of MS-SSIM on those pairs; at or below it, every pair."""
    volumes = _volumes(6, 3)
    every = M.pairwise_ms_ssim(volumes)
    assert (every["pairs"], every["all_pairs"], every["sampled"]) == (15, 15, False)
    assert M.pairwise_ms_ssim(volumes, max_pairs=15) == every
    some = M.pairwise_ms_ssim(volumes, max_pairs=5, seed=1)
    assert (some["pairs"], some["all_pairs"], some["sampled"], some["n"]) == (5, 15, True, 6)
    assert M.pairwise_ms_ssim(volumes, max_pairs=5, seed=1) == some
    picks = torch.randperm(15, generator=torch.Generator().manual_seed(1))[:5].sort().values
    i, j = M.pair_indices(6, picks)
    assert len(set(zip(i.tolist(), j.tolist()))) == 5 and bool((i < j).all())
    assert some["value"] == pytest.approx(float(M.ms_ssim(volumes[i], volumes[j]).mean()))
    assert M.pairwise_ms_ssim(volumes, max_pairs=5, seed=2)["value"] != some["value"]


def test_ms_ssim_settings_work_from_the_stated_minimum_size_and_refuse_below():
    assert M.MS_SSIM_MIN_SIZE == 20
    assert sum(M.MS_SSIM_SETTINGS.weights) == pytest.approx(1.0, abs=1e-5)
    ok = _volumes(2, 0, (20, 20, 20))
    torch.testing.assert_close(M.ms_ssim(ok, ok), torch.ones(2, dtype=torch.float64))
    small = _volumes(2, 0, (19, 32, 32))
    with pytest.raises(ConfigError) as e:
        M.ms_ssim(small, small)
    assert e.value.key == "data.volume_shape" and "20" in str(e.value)


def test_the_wdm_preset_is_monais_with_kernel_7_and_needs_112_voxels():
    wdm = M.MS_SSIM_PRESETS["wdm"]
    assert wdm.weights == M.WANG_WEIGHTS and wdm.kernel_size == 7 and wdm.min_size == 112
    ok = _volumes(1, 0, (112, 112, 112))
    torch.testing.assert_close(M.ms_ssim(ok, ok, wdm), torch.ones(1, dtype=torch.float64))
    small = _volumes(1, 0, (111, 112, 112))
    with pytest.raises(ConfigError, match="ms_ssim=voxdiff"):
        M.ms_ssim(small, small, wdm)
    assert M.describe(wdm)["ms_ssim"]["preset"] == "wdm" and M.describe()["ms_ssim"]["preset"] == "voxdiff"


def test_mmd_is_zero_for_identical_volumes_and_positive_for_different_ones():
    same = M.histograms(_volumes(1, 0).expand(3, -1, -1, -1, -1))
    assert M.mmd(same, same)["value"] == pytest.approx(0.0, abs=1e-12)
    bright = M.histograms(_volumes(3, 1) * 0.5 + 0.5)
    r = M.mmd(bright, M.histograms(_volumes(4, 2)))
    assert r["value"] > 1e-3 and r["n"] == 3  # sets of unequal size: the first min(N) of each


def test_histograms_are_normalised_and_respect_the_mask():
    v = torch.zeros(SHAPE)
    v[..., :12, :, :] = 1.0
    mask = (v > 0.5).float()
    h_in, h_out = M.histograms(v, 4, mask, inside=True), M.histograms(v, 4, mask, inside=False)
    torch.testing.assert_close(h_in, torch.tensor([[0.0, 0, 0, 1]], dtype=torch.float64))
    torch.testing.assert_close(h_out, torch.tensor([[1.0, 0, 0, 0]], dtype=torch.float64))


def test_frechet_of_a_set_with_itself_is_zero_and_finite_for_n_below_the_feature_dim():
    x = torch.randn(6, 512, generator=torch.Generator().manual_seed(0))
    r = M.frechet_distance(x, x.clone())
    assert r["value"] == pytest.approx(0.0, abs=1e-3) and r["dim"] == 512 and r["n_generated"] == 6
    y = torch.randn(6, 512, generator=torch.Generator().manual_seed(1)) + 0.5
    d = M.frechet_distance(x, y)["value"]
    assert math.isfinite(d) and d > 100  # shifted mean: 512 * 0.25 = 128 from the means alone


def test_frechet_survives_where_monai_alone_fails():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(6, 512, generator=g), torch.randn(6, 512, generator=g) + 0.1
    base = M.frechet_distance(x, y)
    scale = 1e4  # the same sets in other units: MONAI's sqrtm now returns a large imaginary part
    with pytest.raises(ValueError, match="Imaginary component"):
        FIDMetric()(x * scale, y * scale)
    big = M.frechet_distance(x * scale, y * scale)
    assert big["sqrtm"] == "symmetric-eig"
    assert big["value"] == pytest.approx(base["value"] * scale**2, rel=1e-6)  # FD scales with the square


def test_frechet_fallback_agrees_with_monai_on_a_well_conditioned_case():
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(300, 8, generator=g), torch.randn(200, 8, generator=g) * 1.5 + 0.3
    r = M.frechet_distance(x, y)
    assert r["sqrtm"] == "scipy"
    assert M._frechet_symmetric(x.double(), y.double()) == pytest.approx(r["value"], rel=1e-9)


def test_frechet_refuses_a_single_sample():
    with pytest.raises(ValueError, match="at least 2"):
        M.frechet_distance(torch.randn(1, 16), torch.randn(5, 16))


def test_codebook_usage_on_a_known_histogram():
    u = M.codebook_usage(torch.tensor([0, 1, 2, 3] * 5), num_embeddings=8)
    assert u["perplexity"] == pytest.approx(4.0) and u["used"] == 4 and u["dead"] == 4 and u["n_latents"] == 20
    assert M.codebook_usage(torch.zeros(10, dtype=torch.long), 8)["perplexity"] == pytest.approx(1.0)


def test_intensity_stats_measure_the_lesion_contrast():
    image = torch.full(SHAPE, 0.5)
    mask = torch.zeros(SHAPE)
    mask[..., 10:14, 10:14, 10:14] = 1
    image[mask > 0] = 0.9
    s = M.intensity_stats(image, mask)
    assert s["mean_inside"] == pytest.approx(0.9) and s["mean_shell"] == pytest.approx(0.5)
    assert s["contrast"] == pytest.approx(0.4)
    shell = M.lesion_shell(mask)
    assert int(shell.sum()) == 8**3 - 4**3  # a 2-voxel shell around a 4^3 cube


def test_chunked_calls_give_the_same_figures(monkeypatch):
    a, b = _volumes(5, 0), _volumes(5, 1)
    whole = (M.ssim(a, b), M.ms_ssim(a, b), M.psnr(a, b), M.pairwise_ms_ssim(a)["value"])
    monkeypatch.setattr(M, "VOXELS_PER_CALL", 2 * a[0].numel())  # two volumes per MONAI call
    assert M._chunks(5, a[0].numel()) == [slice(0, 2), slice(2, 4), slice(4, 5)]
    chunked = (M.ssim(a, b), M.ms_ssim(a, b), M.psnr(a, b), M.pairwise_ms_ssim(a)["value"])
    for w, c in zip(whole, chunked):
        torch.testing.assert_close(torch.as_tensor(c), torch.as_tensor(w))


def _phantoms(n, shape=(32, 48, 48)):
    """``n`` phantom heads ``(n, 1, D, H, W)`` and their tissue labels ``(n, D, H, W)``."""
    from voxdiff.data.phantom import make_phantom

    made = [make_phantom(shape, seed, return_labels=True) for seed in range(n)]
    return (torch.stack([torch.from_numpy(img)[None] for img, _, _ in made]),
            torch.stack([torch.from_numpy(lab.astype("int64")) for _, _, lab in made]))


@pytest.fixture(scope="module")
def heads():
    return _phantoms(3)


def test_the_head_mask_holds_the_skull_and_ventricles_and_not_the_background(heads):
    from voxdiff.data.phantom import LABELS

    images, labels = heads
    head = M.head_mask(images)[:, 0]
    assert head.shape == labels.shape and head.dtype == torch.bool
    for tissue in ("ventricle", "white_matter", "grey_matter"):
        inside = head[labels == LABELS[tissue]].double().mean()
        assert inside == 1.0, tissue
    # the dark skull tables and the CSF rim lie inside the bright scalp: filled (a slice may open at the neck)
    assert head[labels == LABELS["skull"]].double().mean() > 0.9
    assert head[labels == LABELS["csf"]].double().mean() > 0.9
    # the outline, smoothed by a voxel, takes about one voxel of background around the scalp: 6% at 32x48x48
    assert head[labels == LABELS["background"]].double().mean() < 0.1


def test_anatomy_of_a_set_against_itself_and_against_its_blurred_copy(heads):
    images, _ = heads
    same = M.anatomy_comparison(images, images)
    assert same["sharpness_ratio"] == pytest.approx(1.0) and same["dark_ratio"] == pytest.approx(1.0)
    assert same["tissue_distance"] == pytest.approx(0.0, abs=1e-12)
    assert sum(same["fractions_real"].values()) == pytest.approx(1.0)
    # the phantom's heads: about a quarter of the head is CSF-dark (CSF, ventricles, skull tables)
    assert 0.15 < same["fractions_real"]["dark"] < 0.35
    blurred = M._smooth(images, 1.5).float()
    b = M.anatomy_comparison(blurred, images)
    assert b["sharpness_ratio"] < 0.75  # measured 0.64 at 32x48x48
    assert b["tissue_distance"] > 0.15 and b["dark_ratio"] < 0.8  # CSF and white matter mix into grey
    # the mean of the heads (one head for all, as an undertrained model draws) has no ventricles or sulci left
    mean = M.anatomy_comparison(images.mean(0, keepdim=True).expand_as(images), images)
    assert mean["sharpness_ratio"] < 0.9 and mean["tissue_distance"] > 0.15


def test_noise_does_not_pass_for_sharpness(heads):
    images, _ = heads
    blurred = M._smooth(images, 1.5).float()
    g = torch.Generator().manual_seed(0)
    noisy = (blurred + 0.15 * torch.randn(blurred.shape, generator=g)).clamp(0, 1)
    assert M.anatomy_comparison(noisy, images)["sharpness_ratio"] < 0.75  # measured 0.71
    # without the smoothing before the gradient the same noise would read as more detail than the real heads (1.18)
    grads = torch.gradient(noisy.double(), dim=(2, 3, 4))
    raw = torch.sqrt(sum(x * x for x in grads))[M.head_mask(noisy)].mean()
    grads = torch.gradient(images.double(), dim=(2, 3, 4))
    assert raw / torch.sqrt(sum(x * x for x in grads))[M.head_mask(images)].mean() > 1.0


def test_anatomy_stats_refuse_a_volume_without_a_channel_axis():
    with pytest.raises(ValueError, match=r"\(N, 1, D, H, W\)"):
        M.anatomy_stats(torch.zeros(2, 8, 8, 8))


def test_slope_is_least_squares_with_its_standard_error():
    x = [0.0, 1.0, 2.0, 3.0]
    exact = M.slope(x, [1.0 + 2.5 * v for v in x])
    assert exact["value"] == pytest.approx(2.5) and exact["se"] == pytest.approx(0.0, abs=1e-12) and exact["n"] == 4
    noisy = M.slope(x, [0.0, 1.0, 1.0, 4.0])  # numpy.polyfit: slope 1.2; se √(Σres² / (n − 2) / Sxx) = √(1.8/2/5)
    assert noisy["value"] == pytest.approx(1.2) and noisy["se"] == pytest.approx(math.sqrt(1.8 / 2 / 5))
    assert math.isnan(M.slope([1.0, 1.0], [0.0, 1.0])["value"])  # x constant: no slope
    assert math.isnan(M.slope([0.0, 1.0], [0.0, 1.0])["se"])  # two points: no residual to estimate it from
    with pytest.raises(ValueError):
        M.slope([1.0], [1.0])


def test_paired_effect_cancels_what_differs_between_groups():
    """Each group (a mask drawn at three values with one noise) has its own offset, 100 voxels apart: the slope over
    all samples mixes them in, the effect within the groups does not."""
    x = [20.0, 20.0, 50.0, 50.0, 80.0, 80.0]
    groups = [0, 1, 0, 1, 0, 1]
    y = [0.5 * v + 100.0 * g for v, g in zip(x, groups)]
    effect = M.paired_effect(x, y, groups)
    assert effect["value"] == pytest.approx(0.5) and effect["n"] == 2 and effect["per_group"] == [0.5, 0.5]
    assert effect["se"] == pytest.approx(0.0, abs=1e-12)
    assert M.pearson(x, y)["value"] < 0.5  # over all samples the offsets hide it
    uneven = M.paired_effect(x, [0.5 * v + 100.0 * g + (3.0 * v if g else 0.0) for v, g in zip(x, groups)], groups)
    assert uneven["value"] == pytest.approx(2.0) and uneven["se"] == pytest.approx(1.5)  # slopes 0.5 and 3.5
    assert uneven["t"] == pytest.approx(2.0 / 1.5)
    with pytest.raises(ValueError, match="group 1 has fewer than 2 distinct values"):
        M.paired_effect([1.0, 2.0, 3.0, 3.0], [0.0] * 4, [0, 0, 1, 1])


def test_a_probes_leave_one_out_predictions_are_those_of_refitting_without_each_volume():
    """The closed form against the definition: ridge with an unpenalised intercept on the standardised features,
    refitted N times without one volume each, predicting it."""
    g = torch.Generator().manual_seed(0)
    x = torch.rand((12, 30), generator=g, dtype=torch.float64)
    y = x[:, :3].sum(1) * 10 + torch.rand(12, generator=g, dtype=torch.float64)
    probe = M.fit_probe(x, y.tolist(), alphas=(3.0,))
    z = (x - probe.mean) / probe.scale
    design = torch.cat([torch.ones(12, 1, dtype=torch.float64), z], 1)
    penalty = torch.diag(torch.tensor([0.0] + [3.0] * 30, dtype=torch.float64))
    loo = []
    for i in range(12):
        keep = [j for j in range(12) if j != i]
        a, b = design[keep], y[keep]
        beta = torch.linalg.solve(a.T @ a + penalty, a.T @ b)
        loo.append(float(design[i] @ beta))
    assert probe.loo_r == pytest.approx(M.pearson(y, loo)["value"], abs=1e-9)
    full = torch.linalg.solve(design.T @ design + penalty, design.T @ y)  # the probe itself: every volume
    torch.testing.assert_close(probe(x), design @ full)


def test_a_probe_reads_a_planted_signal_and_not_noise():
    g = torch.Generator().manual_seed(1)
    x = torch.rand((40, 64), generator=g, dtype=torch.float64)
    signal = x[:, 5] - x[:, 9]
    planted = M.fit_probe(x, (signal + 0.05 * torch.randn(40, generator=g, dtype=torch.float64)).tolist())
    assert planted.loo_r > 0.7 and planted.n == 40 and planted.alpha in M.PROBE_ALPHAS
    fresh = torch.rand((40, 64), generator=g, dtype=torch.float64)
    assert M.pearson((fresh[:, 5] - fresh[:, 9]).tolist(), planted(fresh).tolist())["value"] > 0.7  # new volumes
    noise = M.fit_probe(x, torch.randn(40, generator=g, dtype=torch.float64).tolist())
    assert noise.loo_r < 0.3
    constant = x.clone()
    constant[:, 0] = 1.0  # a feature constant over the real volumes is left out, not divided by 0
    assert torch.isfinite(M.fit_probe(constant, signal.tolist())(x)).all()
    with pytest.raises(ValueError, match="constant"):
        M.fit_probe(x, [1.0] * 40)
