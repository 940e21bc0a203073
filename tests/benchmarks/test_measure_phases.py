"""``bench/measure_phases.py`` measures on a GPU only; what it holds the measurements against is the preflight's, and
runs here: with CUDA graphs (a GPU run's default) the verdict's figures, the two-pool reserved estimate and
validation and sampling beside the graphs' pool; without them, no pool."""

from __future__ import annotations

import pytest

from script_modules import ROOT, load_script


@pytest.mark.parametrize("overrides, graphs", [([], True), (["model.compile_mode=null"], False)])
def test_the_prediction_a_measured_row_is_held_against(tmp_path, monkeypatch, overrides, graphs):
    monkeypatch.setenv("VOXDIFF_TARGET", "gpu")
    monkeypatch.syspath_prepend(str(ROOT / "bench"))  # as when the script runs: its folder is on the path
    bench = load_script("bench/measure_phases.py")
    cfg = bench.compose_run("exp11", overrides, str(tmp_path))
    pred = bench.predicted(cfg)
    assert (pred["pred_graph_pool"] > 0) == graphs
    assert pred["pred_validation_beside_pool"] == pytest.approx(pred["pred_validation"] + pred["pred_graph_pool"])
    assert pred["pred_sampling_beside_pool"] == pytest.approx(pred["pred_sampling"] + pred["pred_graph_pool"])
    assert pred["pred_reserved_training"] >= pred["pred_training"]
