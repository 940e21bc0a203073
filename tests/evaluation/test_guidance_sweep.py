"""``voxdiff.evaluation.guidance_sweep``: a guidance sweep's figures side by side, each ranked by its direction."""

from __future__ import annotations

import math

import numpy as np
import pytest

from voxdiff.evaluation.guidance_sweep import summarise, target
from voxdiff.evaluation.uncertainty import Bootstrap


def _record(**figures: tuple[float, str]) -> dict:
    return {"figures": {name: {"value": value, "direction": direction, "label": name}
                        for name, (value, direction) in figures.items()}}


def _at(scale_values: dict[str, float], directions: dict[str, str]) -> dict:
    return _record(**{k: (v, directions[k]) for k, v in scale_values.items()})


DIRECTIONS = {"psnr": "higher", "mmd_histogram": "lower", "lesion_contrast_generated": "match",
              "lesion_contrast_real": "info", "covariate_age_ventricles_control": "lower",
              "covariate_age_ventricles_effect_generated": "match", "covariate_age_ventricles_effect_real": "info"}


def test_each_figure_prefers_the_scale_its_direction_says_and_the_real_and_control_figures_are_not_ranked():
    rows = [
        {"psnr": 20.0, "mmd_histogram": 0.02, "lesion_contrast_generated": 0.30, "lesion_contrast_real": 0.45,
         "covariate_age_ventricles_control": 0.01, "covariate_age_ventricles_effect_generated": 1.3,
         "covariate_age_ventricles_effect_real": 3.0},
        {"psnr": 21.0, "mmd_histogram": 0.01, "lesion_contrast_generated": 0.50, "lesion_contrast_real": 0.45,
         "covariate_age_ventricles_control": -0.4, "covariate_age_ventricles_effect_generated": 2.7,
         "covariate_age_ventricles_effect_real": 3.0},
        {"psnr": 19.0, "mmd_histogram": 0.03, "lesion_contrast_generated": 0.43, "lesion_contrast_real": 0.45,
         "covariate_age_ventricles_control": 0.2, "covariate_age_ventricles_effect_generated": 4.8,
         "covariate_age_ventricles_effect_real": 3.0},
    ]
    summary = summarise("autoguide_scale", [1.0, 1.1, 1.25], [_at(r, DIRECTIONS) for r in rows])
    f = summary["figures"]
    assert summary["swept"] == "autoguide_scale" and summary["values"] == [1.0, 1.1, 1.25]
    assert f["psnr"]["values"] == [20.0, 21.0, 19.0] and f["psnr"]["best"] == 1.1
    assert f["mmd_histogram"]["best"] == 1.1
    # matched to the real twin: 0.43 is closer to 0.45 than 0.50 is
    assert f["lesion_contrast_generated"]["target"] == 0.45 and f["lesion_contrast_generated"]["best"] == 1.25
    assert f["covariate_age_ventricles_effect_generated"]["target"] == 3.0
    assert f["covariate_age_ventricles_effect_generated"]["best"] == 1.1
    # shown, not ranked: the real set's own figure, and the negative control's (whose "lower" would pick -0.4)
    assert f["lesion_contrast_real"]["best"] is None
    assert f["covariate_age_ventricles_control"]["best"] is None
    assert f["covariate_age_ventricles_control"]["values"] == [0.01, -0.4, 0.2]


def test_a_ratio_to_the_real_set_is_matched_to_1_and_a_match_without_target_is_not_ranked():
    sharp = [{"value": v, "direction": "match", "label": "sharpness", "generated": {"value": v}, "real": {"value": 1}}
             for v in (0.7, 1.2, 0.95)]
    records = [{"figures": {"anatomy_sharpness": s, "orphan_generated": {"value": 1.0 + i, "direction": "match"}}}
               for i, s in enumerate(sharp)]
    assert target("anatomy_sharpness", records[0]["figures"]) == 1.0
    assert target("orphan_generated", records[0]["figures"]) is None
    f = summarise("guidance_scale", [1, 2, 3], records)["figures"]
    assert f["anatomy_sharpness"]["best"] == 3 and f["anatomy_sharpness"]["target"] == 1.0
    assert f["orphan_generated"]["best"] is None


def test_a_figure_missing_at_one_scale_is_left_out_and_a_non_finite_one_is_not_ranked():
    records = [_record(psnr=(20.0, "higher"), fid=(1.0, "lower")), _record(psnr=(math.nan, "higher"))]
    f = summarise("autoguide_scale", [1.0, 1.5], records)["figures"]
    assert set(f) == {"psnr"} and f["psnr"]["best"] is None


def test_one_scale_per_record():
    with pytest.raises(ValueError, match="2 scales for 1 evaluations"):
        summarise("autoguide_scale", [1.0, 1.5], [_record(psnr=(20.0, "higher"))])


def test_a_standard_error_given_at_every_scale_is_kept_beside_the_values():
    records = [{"figures": {"covariate_age_ventricles_effect_generated": {"value": v, "se": e, "direction": "match"},
                            "covariate_age_ventricles_effect_real": {"value": 3.0, "direction": "info"},
                            "psnr": {"value": 17.0, "direction": "higher"}}} for v, e in ((1.3, 0.2), (2.7, 0.5))]
    f = summarise("autoguide_scale", [1.0, 1.1], records)["figures"]
    assert f["covariate_age_ventricles_effect_generated"]["se"] == [0.2, 0.5]
    assert "se" not in f["psnr"]


def _with_se(name: str, direction: str, points: list[tuple[float, float]], real: float | None = None) -> list[dict]:
    records = []
    for v, e in points:
        figures = {name: {"value": v, "se": e, "direction": direction, "label": name},
                   "psnr": {"value": 17.0, "direction": "higher"}}
        if real is not None:
            figures[name.replace("_generated", "_real")] = {"value": real, "direction": "info"}
        records.append({"figures": figures})
    return records


def test_scales_within_one_standard_error_of_the_preferred_one_are_tied_with_it():
    """higher: 2.3 +- 0.2 is preferred, 2.1 +- 0.2 lies within one standard error of the difference (0.28) and 1.0 does
    not; match: the distance to the real twin's 3.0 is compared, 3.3 +- 0.3 (0.3 away) tied with 2.9 +- 0.1 (0.1
    away), 2.0 not. A figure without standard errors has no ties to report."""
    f = summarise("autoguide_scale", [1.0, 1.25, 1.5],
                  _with_se("effect", "higher", [(1.0, 0.1), (2.1, 0.2), (2.3, 0.2)]))["figures"]
    assert f["effect"]["best"] == 1.5 and f["effect"]["tied"] == [1.25]
    assert "tied" not in f["psnr"]
    f = summarise("autoguide_scale", [1.0, 1.25, 1.5],
                  _with_se("effect_generated", "match", [(2.0, 0.1), (2.9, 0.1), (3.3, 0.3)], real=3.0))["figures"]
    assert f["effect_generated"]["best"] == 1.25 and f["effect_generated"]["tied"] == [1.5]
    # narrower errors separate them
    f = summarise("autoguide_scale", [1.0, 1.25, 1.5],
                  _with_se("effect_generated", "match", [(2.0, 0.1), (2.9, 0.05), (3.3, 0.05)], real=3.0))["figures"]
    assert f["effect_generated"]["tied"] == []


def test_the_sweep_page_bolds_the_preferred_scale_and_those_tied_with_it():
    from voxdiff.evaluation.report import render_sweep_html

    summary = summarise("autoguide_scale", [1.0, 1.25, 1.5],
                        _with_se("effect", "higher", [(1.0, 0.1), (2.1, 0.2), (2.3, 0.2)]))
    page = render_sweep_html("sweep", {}, summary, ["a/report.html", "b/report.html", "c/report.html"], b"")
    row = next(r for r in page.split("<tr>") if "<code>effect</code>" in r)
    assert row.count("<b>") == 2 and "<b>2.1 ± 0.2</b>" in row and "<b>2.3 ± 0.2</b>" in row
    psnr = next(r for r in page.split("<tr>") if "<code>psnr</code>" in r)
    assert psnr.count("<b>") == 1  # no standard error: the preferred scale alone


def _drawn(per_sample: dict[str, list[float]], real: list[float] | None = None) -> list[dict]:
    """One record per scale from per-sample figures (sample i drawn from the same mask and noise at every scale),
    with each figure's resampler and its bootstrap standard error, as ``evaluate()`` returns them."""
    import torch

    from voxdiff.evaluation import uncertainty as U

    records = []
    for values in per_sample.values():
        v = torch.tensor(values, dtype=torch.float64)
        figures = {"figure_generated" if real else "figure": {
            "value": float(v.mean()), "direction": "match" if real else "higher", "label": "f",
            "se": float(v.std() / math.sqrt(len(v)))}}
        resamplers = {next(iter(figures)): U.mean_of(v)}
        if real:
            r = torch.tensor(real, dtype=torch.float64)
            figures["figure_real"] = {"value": float(r.mean()), "direction": "info", "label": "r"}
            resamplers["figure_real"] = U.mean_of(r, "real")
        records.append({"figures": figures, "resamplers": resamplers, "n_generated": len(values),
                        "n_real": len(real) if real else len(values)})
    return records


def test_a_paired_bootstrap_separates_scales_that_differ_in_every_sample_by_less_than_samples_differ():
    """Sample i at every scale shares its mask and noise: 0.05 higher at 1.25 than at 1 in every one of 20 samples
    that themselves spread by 1. Compared as two evaluations (one standard error each, 0.22) the scales are tied;
    paired, the difference is 0.05 on every resample: not tied. A scale whose samples move by ±0.2 at random about
    scale 1's is tied with the preferred one, paired too."""
    rng = np.random.default_rng(0)
    x = rng.normal(0.0, 1.0, 20)
    noise = rng.normal(0.0, 0.2, 20)
    records = _drawn({"1": list(x), "1.25": list(x + 0.05), "1.5": list(x + noise - noise.mean())})
    scales = [1.0, 1.25, 1.5]
    by_se = summarise("autoguide_scale", scales, records)["figures"]["figure"]
    assert by_se["best"] == 1.25 and by_se["tied"] == [1.0, 1.5] and by_se["tie_rule"] == "one standard error"
    paired = summarise("autoguide_scale", scales, records, Bootstrap(resamples=1000))["figures"]["figure"]
    assert paired["best"] == 1.25 and paired["tie_rule"] == "paired bootstrap"
    assert paired["differences"]["1"] == pytest.approx([0.05, 0.05])  # the same shift on every resample
    assert paired["tied"] == [1.5] and paired["differences"]["1.5"][0] < 0 < paired["differences"]["1.5"][1]


def test_a_paired_match_figure_is_scored_against_its_real_twin_drawn_on_the_same_resample():
    """The generated figure should match the real one (mean 1.0 over 10 real volumes): scale 1.25 is 0.1 away in
    every sample, scale 1 0.4 away; paired, 1 is not tied with 1.25; a real set too small for an interval (4
    volumes) leaves the figure to the standard-error rule."""
    rng = np.random.default_rng(1)
    x = rng.normal(0.0, 0.5, 12)
    real = rng.normal(1.0, 0.5, 10)
    real = list(real - real.mean() + 1.0)  # mean exactly 1.0
    records = _drawn({"1": list(x - x.mean() + 0.6), "1.25": list(x - x.mean() + 0.9)}, real=real)
    f = summarise("autoguide_scale", [1.0, 1.25], records, Bootstrap(resamples=1000))["figures"]["figure_generated"]
    assert f["best"] == 1.25 and f["tied"] == [] and f["tie_rule"] == "paired bootstrap"
    low, high = f["differences"]["1"]
    assert 0 < low < high <= 0.3 + 1e-12  # |0.6 − R| − |0.9 − R| ≤ 0.3 on every resample, > 0 where R > 0.75
    few = _drawn({"1": list(x - x.mean() + 0.6), "1.25": list(x - x.mean() + 0.9)}, real=real[:4])
    f = summarise("autoguide_scale", [1.0, 1.25], few, Bootstrap(resamples=1000))["figures"]["figure_generated"]
    assert f["tie_rule"] == "one standard error" and "differences" not in f


def test_an_effect_keeps_its_own_standard_error_and_is_tied_paired_over_its_masks():
    """An effect figure carries its standard error over masks (the one-standard-error rule's) and, resampled over
    the masks every scale draws alike (``resample_sizes``), is compared paired: a gain of 0.3 on each of 8 masks
    whose own slopes spread by 1 separates the scales paired, not by standard errors."""
    import torch

    from voxdiff.evaluation import uncertainty as U

    rng = np.random.default_rng(2)
    slopes = rng.normal(1.0, 1.0, 8)
    records = []
    for shift in (0.0, 0.3):
        k = torch.from_numpy(slopes + shift)
        records.append({"figures": {"effect": {"value": float(k.mean()), "se": float(k.std() / math.sqrt(8)),
                                               "direction": "higher", "label": "e"}},
                        "resamplers": {"effect": U.mean_of(k, "masks")}, "resample_sizes": {"masks": 8},
                        "n_generated": 24, "n_real": 8})
    by_se = summarise("autoguide_scale", [1.0, 1.25], records)["figures"]["effect"]
    assert by_se["tied"] == [1.0] and by_se["tie_rule"] == "one standard error"
    paired = summarise("autoguide_scale", [1.0, 1.25], records, Bootstrap(resamples=500))["figures"]["effect"]
    assert paired["best"] == 1.25 and paired["tied"] == [] and paired["differences"]["1"] == pytest.approx([0.3, 0.3])


def _recipe(x: np.ndarray, offsets: np.ndarray, shift: float, seeds: list[int] | None = None) -> list[dict]:
    """A recipe's runs as ``evaluate()`` returns them (:func:`_drawn`, a run in place of a scale): run k's sample i
    is ``x[i] + offsets[k] + shift`` (sample i drawn from the same mask and noise by every run; run k trained with
    ``seeds[k]``, where given)."""
    runs = _drawn({str(k): list(x + o + shift) for k, o in enumerate(offsets)})
    for k, run in enumerate(runs):
        if seeds:
            run["checkpoint"] = {"train_seed": seeds[k]}
    return runs


def test_recipes_are_compared_over_their_runs_and_volumes_and_one_run_each_can_mislead():
    """Two recipes, 6 runs each, whose runs spread alike about means 0.3 apart. Where runs of a recipe differ by
    little (0.05 apart) the paired bootstrap of runs and volumes separates the recipes; where they differ by 0.6, it ties
    them, though a comparison of one run of each (what ``'ckpt_path=[A,B]'`` reads) is sure of a winner, and which
    recipe wins is the draw of the runs: a's first run loses to b's, a's last beats b's."""
    from voxdiff.evaluation.guidance_sweep import recipes

    x = np.random.default_rng(7).normal(0.0, 0.5, 16)
    base = np.array([-1.5, -0.9, -0.3, 0.3, 0.9, 1.5])  # mean 0
    labels = ["1: 6 runs (a)", "2: 6 runs (b)"]
    for scale, tied in ((1 / 12, False), (1.0, True)):
        a, b = _recipe(x, base * scale, 0.0), _recipe(x, base[::-1] * scale, 0.3)
        f = recipes(labels, [a, b], Bootstrap(resamples=1000))["figures"]["figure"]
        assert f["values"] == pytest.approx([float(np.mean(x)), float(np.mean(x)) + 0.3])
        assert f["runs"] == [[r["figures"]["figure"]["value"] for r in g] for g in (a, b)]
        assert f["best"] == labels[1] and f["tie_rule"] == "paired bootstrap" and len(f["ci"]) == 2
        assert f["tied"] == ([labels[0]] if tied else []), (scale, f["differences"])
    first = summarise("ckpt_path", ["a", "b"], [a[0], b[0]], Bootstrap(resamples=1000))["figures"]["figure"]
    last = summarise("ckpt_path", ["a", "b"], [a[-1], b[-1]], Bootstrap(resamples=1000))["figures"]["figure"]
    assert (first["best"], first["tied"], last["best"], last["tied"]) == ("b", [], "a", [])


def test_recipes_of_fewer_than_five_runs_are_tied_within_one_standard_error_over_their_runs():
    """Three runs a recipe are too few to resample: each recipe's standard error is its runs' over √3, the ties
    within one of it, and the summary says what they are over; a recipe of one run is refused."""
    from voxdiff.evaluation.guidance_sweep import RUNS_RULE, recipes

    x = np.linspace(-1, 1, 10)
    a, b = _recipe(x, np.array([0.0, 0.2, 0.4]), 0.0), _recipe(x, np.array([0.0, 0.2, 0.4]), 0.1)
    out = recipes(["a", "b"], [a, b], Bootstrap(resamples=1000))
    f = out["figures"]["figure"]
    assert f["se"] == pytest.approx([0.2 / math.sqrt(3)] * 2)  # std of 0, 0.2, 0.4 is 0.2
    assert f["best"] == "b" and f["tied"] == ["a"] and f["tie_rule"] == RUNS_RULE and "ci" not in f
    assert out["runs"] == [3, 3] and "fewer than 5 runs" in out["intervals_over"]
    b = _recipe(x, np.array([0.0, 0.2, 0.4]), 0.3)  # 0.3 apart: more than one standard error of the difference
    assert recipes(["a", "b"], [a, b])["figures"]["figure"]["tied"] == []
    with pytest.raises(ValueError):
        recipes(["a", "b"], [a, b[:1]])


def test_the_page_of_recipes_links_each_run_and_shows_its_value_under_the_recipe_s():
    from voxdiff.evaluation.guidance_sweep import recipes
    from voxdiff.evaluation.report import render_sweep_html

    x = np.linspace(-1, 1, 10)
    summary = recipes(["1: a", "2: b"], [_recipe(x, np.array([0.0, 0.2]), 0.0), _recipe(x, np.array([0.0, 0.2]), 1)])
    page = render_sweep_html("recipes", {}, summary, [["recipe_1/run_1/report.html", "recipe_1/run_2/report.html"],
                                                      ["recipe_2/run_1/report.html", "recipe_2/run_2/report.html"]],
                             b"")
    assert all(f"href='recipe_{g}/run_{k}/report.html'" in page for g in (1, 2) for k in (1, 2))
    row = next(r for r in page.split("<tr>") if "<code>figure</code>" in r)
    assert "<span class='note'>1, 1.2</span>" in row and "<b>1.1 ± 0.1" in row


def test_the_plot_of_recipes_names_each_by_its_number_and_fits_long_labels():
    """Recipes' labels name every run directory; the plot stands them at 1, 2, ... (the table's columns), so the
    layout fits (a label as tick overflowed it: matplotlib warned "Tight layout not applied")."""
    import io
    import warnings

    from PIL import Image

    from voxdiff.evaluation.guidance_sweep import recipes
    from voxdiff.evaluation.report import sweep_png

    x = np.linspace(-1, 1, 10)
    long = [f"{g}: 6 runs ({', '.join(f'2026-11-28_03-19-0{k}_recipe_{g}' for k in range(6))})" for g in (1, 2)]
    summary = recipes(long, [_recipe(x, np.linspace(0, 0.5, 6), 0.0), _recipe(x, np.linspace(0, 0.5, 6), 1.0)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        png = sweep_png(summary)
    assert Image.open(io.BytesIO(png)).size[0] > 0


def test_runs_of_the_same_seeds_are_paired_and_what_a_seed_does_to_every_recipe_cancels():
    """Six seeds whose runs spread by 1 (the seed's doing: the same offset in both recipes), recipe b 0.1 above a
    in every seed. Listed in the same seed order the runs are paired: the difference is 0.1 on every resample, not
    tied. In another order (or without seeds) the recipes' runs are resampled apart and the seeds' spread ties
    them."""
    from voxdiff.evaluation.guidance_sweep import recipes

    x = np.random.default_rng(8).normal(0.0, 0.5, 12)
    offsets = np.array([-1.5, -0.9, -0.3, 0.3, 0.9, 1.5])
    seeds = [42, 1, 2, 3, 4, 5]
    a, b = _recipe(x, offsets, 0.0, seeds), _recipe(x, offsets, 0.1, seeds)
    out = recipes(["a", "b"], [a, b], Bootstrap(resamples=1000))
    f = out["figures"]["figure"]
    assert out["runs_paired_by_seed"] and "paired by seed" in out["intervals_over"]
    assert f["best"] == "b" and f["tied"] == [] and f["differences"]["a"] == pytest.approx([0.1, 0.1])
    shuffled = _recipe(x, offsets, 0.1, seeds[::-1])
    out = recipes(["a", "b"], [a, shuffled], Bootstrap(resamples=1000))
    assert not out["runs_paired_by_seed"] and out["figures"]["figure"]["tied"] == ["a"]


def test_three_runs_paired_by_seed_are_tied_by_the_spread_of_their_per_seed_differences():
    """Three seeds whose runs spread by 0.2 (the seed's doing, alike in both recipes), b 0.1 above a in every seed:
    too few runs to resample, so paired by seed the tie is judged on the per-seed differences (0.1 each, no spread:
    not tied); listed in other seed orders, on the runs' own spread (0.2/√3 each: tied)."""
    from voxdiff.evaluation.guidance_sweep import RUNS_RULE, SEEDS_RULE, recipes

    x = np.linspace(-1, 1, 10)
    offsets, seeds = np.array([0.0, 0.2, 0.4]), [7, 8, 9]
    a = _recipe(x, offsets, 0.0, seeds)
    f = recipes(["a", "b"], [a, _recipe(x, offsets, 0.1, seeds)], Bootstrap(resamples=1000))["figures"]["figure"]
    assert f["best"] == "b" and f["tied"] == [] and f["tie_rule"] == SEEDS_RULE
    f = recipes(["a", "b"], [a, _recipe(x, offsets, 0.1, seeds[::-1])])["figures"]["figure"]
    assert f["tied"] == ["a"] and f["tie_rule"] == RUNS_RULE


def test_a_setting_swept_over_one_recipe_s_runs_pairs_them_run_by_run_whatever_their_seeds():
    """A guidance scale swept over the same six runs (no seeds recorded): scale 1.2 scores 0.1 above 1 in every run,
    the runs spread by 1. Swept over the runs (``swept``), each resample draws the same runs at both scales: not
    tied; read as two recipes of unpaired runs, the runs' spread ties them. With three runs, the per-run
    differences (no spread) separate them."""
    from voxdiff.evaluation.guidance_sweep import RUN_PAIRS_RULE, RUNS_RULE, recipes

    x = np.random.default_rng(8).normal(0.0, 0.5, 12)
    offsets = np.array([-1.5, -0.9, -0.3, 0.3, 0.9, 1.5])
    at_1, at_12 = _recipe(x, offsets, 0.0), _recipe(x, offsets, 0.1)
    out = recipes([1.0, 1.2], [at_1, at_12], Bootstrap(resamples=1000), swept="guidance_scale")
    f = out["figures"]["figure"]
    assert out["swept"] == "guidance_scale" and out["values"] == [1.0, 1.2] and out["same_runs"]
    assert not out["runs_paired_by_seed"] and "the same runs at every value" in out["intervals_over"]
    assert f["best"] == 1.2 and f["tied"] == [] and f["differences"]["1"] == pytest.approx([0.1, 0.1])
    assert f["runs"] == [pytest.approx(list(x.mean() + offsets)), pytest.approx(list(x.mean() + offsets + 0.1))]
    unpaired = recipes([1.0, 1.2], [at_1, at_12], Bootstrap(resamples=1000))
    assert not unpaired["same_runs"] and unpaired["figures"]["figure"]["tied"] == [1.0]
    three = recipes([1.0, 1.2], [_recipe(x, offsets[:3], 0.0), _recipe(x, offsets[:3], 0.1)], swept="guidance_scale")
    f = three["figures"]["figure"]
    assert f["tie_rule"] == RUN_PAIRS_RULE and f["tied"] == [] and "per-run differences" in three["intervals_over"]
    f = recipes([1.0, 1.2], [_recipe(x, offsets[:3], 0.0), _recipe(x, offsets[:3], 0.1)])["figures"]["figure"]
    assert f["tie_rule"] == RUNS_RULE and f["tied"] == [1.0]


def test_each_recipe_s_runs_are_put_in_the_first_recipe_s_seed_order_where_they_hold_the_same_seeds():
    from voxdiff.evaluation.guidance_sweep import seed_order

    def group(*seeds):
        return [{"checkpoint": {"train_seed": s}} for s in seeds]

    assert seed_order([group(42, 1, 2), group(2, 42, 1), group(42, 1, 2)]) == [[0, 1, 2], [1, 2, 0], [0, 1, 2]]
    assert seed_order([group(42, 1), group(1, 3)]) is None  # seed 42 has no run in the second
    assert seed_order([group(1, 1), group(1, 1)]) is None  # a seed twice: which run pairs with which?
    assert seed_order([group(1, 2), group(1, 2, 3)]) is None
    assert seed_order([[{"checkpoint": {}}, {}], group(1, 2)]) is None  # no seed recorded
