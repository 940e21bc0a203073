"""The report's parts: the loss log of a resumed run, the HTML page (self-contained, one row per figure)."""

import base64

import pytest

from voxdiff.evaluation.report import (data_uri, lesion_distribution_png, loss_curve_png, read_loss_log, render_html,
                                      scatter_png)


def _csv(path, rows):
    path.parent.mkdir(parents=True)
    path.write_text("epoch,step,train/loss,val/loss\n" + "".join(f"0,{s},{t},{v}\n" for s, t, v in rows))


def test_a_resumed_run_replaces_the_steps_it_logged_again(tmp_path):
    import os

    _csv(tmp_path / "csv" / "version_0" / "metrics.csv", [(0, 1.0, ""), (10, 0.5, ""), (20, 0.4, 0.45)])
    os.utime(tmp_path / "csv" / "version_0" / "metrics.csv", (1, 1))  # older
    _csv(tmp_path / "csv" / "version_1" / "metrics.csv", [(20, 0.3, ""), (30, 0.2, 0.25)])
    series = read_loss_log(tmp_path)
    assert series["train/loss"] == [(0, 1.0), (10, 0.5), (20, 0.3), (30, 0.2)]
    assert series["val/loss"] == [(20, 0.45), (30, 0.25)]
    png = loss_curve_png(series, step=30)
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_page_is_self_contained_with_one_row_per_figure():
    png = loss_curve_png({"train/loss": [(0, 1.0), (1, 0.5)]})
    figures = {"psnr": {"value": 20.5, "std": 1.0, "n": 4, "direction": "higher", "definition": "d", "label": "PSNR"},
               "fd": {"value": 3.0, "n_generated": 4, "n_real": 2, "direction": "lower", "definition": "e"}}
    page = render_html("t", {"checkpoint": "x"}, figures, {"medicalnet": "no file"},
                       [("Loss", "", [(data_uri(png), "loss")])])
    assert page.count("<tr><td>") == 2 and "4 gen / 2 real" in page and "no file" in page
    uri = page.split("src='")[1].split("'")[0]
    assert base64.b64decode(uri.split(",", 1)[1]) == png
    assert "http" not in page


def test_a_row_shows_its_spread_and_its_ratio_to_real():
    figures = {
        "ventricles": {"value": 34.05, "std": 20.5, "n": 40, "ratio_to_real": 0.5422, "label": "ventricles"},
        "effect": {"value": 1.2111, "se": 0.3597, "t": 3.37, "n": 10, "ratio_to_real": 0.4064, "label": "effect"},
        "r": {"value": 0.4679, "n": 40, "label": "r"},
    }
    page = render_html("t", {}, figures, {}, [])
    rows = page.split("<tr><td>")[1:]
    assert "34.05 ± 20.5; 0.5422× real</td>" in rows[0]
    assert "1.211 ± 0.3597 (se); 0.4064× real</td>" in rows[1]
    assert "0.4679</td>" in rows[2]  # no spread, no ratio: the value alone


def test_a_scatter_joins_each_groups_points_only_where_asked():
    """Counterfactuals: two masks at three ages each; the model's points of one mask are joined by a line."""
    ages, measure = [30.0, 30.0, 50.0, 50.0, 70.0, 70.0], [1.0, 5.0, 2.0, 7.0, 4.0, 8.0]
    series = {"generated": (ages, measure), "real": ([35.0, 60.0], [2.0, 6.0])}
    plain = scatter_png(series, "age", "ventricles")
    assert plain == scatter_png(series, "age", "ventricles", groups={})
    joined = scatter_png(series, "age", "ventricles", groups={"generated": [0, 1, 0, 1, 0, 1]})
    assert joined[:8] == b"\x89PNG\r\n\x1a\n" and joined != plain
    with pytest.raises(ValueError):  # a group for every point, or none
        scatter_png(series, "age", "ventricles", groups={"generated": [0, 1]})


def test_a_row_with_a_bootstrap_interval_shows_it_with_its_level_and_the_page_says_what_it_means():
    figures = {"contrast": {"value": 0.318, "n": 8, "ci": [0.2805, 0.3726], "ci_level": 0.95, "se": 0.023,
                            "label": "contrast"},
               "fd": {"value": 0.033, "n_generated": 8, "n_real": 8, "label": "fd"}}
    page = render_html("t", {}, figures, {}, [])
    rows = page.split("<tr><td>")[1:]
    assert "<td class='num'>0.318 ± 0.023 (se)</td><td class='num'>[0.2805, 0.3726] (95%)</td>" in rows[0]
    assert "<td class='num'>0.033</td><td class='num'></td>" in rows[1]
    assert "Two evaluations whose intervals overlap widely" in page
    assert "overlap widely" not in render_html("t", {}, {"fd": figures["fd"]}, {}, [])  # no interval, no note


def test_the_lesion_figure_shows_shares_of_masks_and_of_lesions(monkeypatch):
    """The bars are shares: of masks by lesion count (12 lesions in a mask pooled into the last, "≥10", bar), and of
    lesions by size band, each set's bands padded to the longer set's."""
    import voxdiff.evaluation.report as R

    made = []
    monkeypatch.setattr(R, "png_bytes", lambda fig: made.append(fig) or b"\x89PNG")
    counts = {"real": [1, 2, 2, 3], "generated": [0, 0, 12, 1]}
    sizes = {"real": {"edges": [1, 2, 4, 8], "lesions": [0, 2, 6]},
             "generated": {"edges": [1, 2, 4, 8, 16, 32], "lesions": [10, 0, 0, 1, 2]}}
    assert lesion_distribution_png(counts, sizes) == b"\x89PNG"
    by_count, by_size = made[0].axes
    real, generated = (by_count.patches[k * 11:(k + 1) * 11] for k in range(2))
    assert [p.get_height() for p in real][:4] == [0, 0.25, 0.5, 0.25]
    assert [p.get_height() for p in generated] == [0.5, 0.25, *[0] * 8, 0.25]
    assert [t.get_text() for t in by_count.get_xticklabels()][-1] == "≥10"
    real, generated = by_size.patches[:5], by_size.patches[5:]
    assert [p.get_height() for p in real] == [0, 0.25, 0.75, 0, 0]
    assert [round(p.get_height(), 6) for p in generated] == [round(v / 13, 6) for v in (10, 0, 0, 1, 2)]


def test_the_lesion_figure_is_a_png():
    png = lesion_distribution_png({"real": [1], "generated": [0]}, {"real": {"edges": [1, 2], "lesions": [1]},
                                                                    "generated": {"edges": [1, 2], "lesions": [0]}})
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
