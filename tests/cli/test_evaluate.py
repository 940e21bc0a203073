"""``evaluate.py``: a tiny run trained here, evaluated at an early and a late checkpoint; metrics.json, the
self-contained report (rendered by a real headless Chromium), samples with the source affine, the direction of
the figures, a VQ-VAE checkpoint (the report follows the checkpoint's kind), and refused configs."""

import contextlib
import json
import math
import re
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
from omegaconf import OmegaConf
from voxdiff.cli.evaluate import evaluate, validate
from voxdiff.cli.train import train
from voxdiff.config import compose
from voxdiff.errors import ConfigError
from voxdiff.encodings.vqvae import read_stage1_checkpoint
from voxdiff.evaluation.features import file_sha256
from voxdiff.preflight.stage1 import predict_reconstruction

from chromium import render  # noqa: E402  (tests/cli is on sys.path, as tests/slurm is)

SHAPE = (24, 32, 32)  # the smallest axis MS-SSIM's settings allow is 20
QUIET = ["logger=csv", "trainer.accelerator=cpu", "trainer.enable_model_summary=false",
         "trainer.enable_progress_bar=false", "callbacks.progress_bar=null"]
TINY = [
    "experiment=demo", *QUIET,
    f"data.volume_shape=[{SHAPE[0]},{SHAPE[1]},{SHAPE[2]}]", "data.num_subjects=6",
    "model.channels=[8,16,16]", "model.num_res_blocks=1", "model.num_head_channels=8", "model.norm_num_groups=4",
    "system.sampling.final=false", "system.ema.start_step=0", "system.ema.decay=0.8",
    "trainer.max_steps=40", "trainer.check_val_every_n_epoch=5", "trainer.log_every_n_steps=2",
]


def _trained(out: Path, *overrides: str) -> tuple[Path, Path]:
    """40 steps of the tiny model into ``out``: its step-2 checkpoint (``out/steps/step002.ckpt``) and its last."""
    report = train(compose("train", [
        *TINY, *overrides, f"paths.output_dir={out}",
        "+callbacks.early._target_=lightning.pytorch.callbacks.ModelCheckpoint", f"+callbacks.early.dirpath={out}/steps",
        "+callbacks.early.filename='step{step:03d}'", "+callbacks.early.auto_insert_metric_name=false",
        "+callbacks.early.every_n_train_steps=2", "+callbacks.early.monitor=step", "+callbacks.early.mode=min",
        "+callbacks.early.save_top_k=1"]))  # keeps the first: step 2
    early = out / "steps" / "step002.ckpt"
    assert early.is_file()
    return early, Path(report["last_checkpoint"])


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """40 steps of a tiny bravo model; checkpoints at step 2 (early) and 40 (late), a CSV log."""
    out = tmp_path_factory.mktemp("run")
    return out, *_trained(out)


def _evaluate(ckpt, out, *overrides):
    cfg = compose("evaluate", [f"ckpt_path={ckpt}", f"paths.output_dir={out}", "n=4", "num_inference_steps=5",
                               "montages=2", *overrides])
    validate(cfg)
    return evaluate(cfg)


@pytest.fixture(scope="module")
def late(run, tmp_path_factory):
    _, _, last = run
    out = tmp_path_factory.mktemp("eval_late")
    return _evaluate(last, out), out


@pytest.fixture(scope="module")
def early(run, tmp_path_factory):
    _, ckpt, _ = run
    return _evaluate(ckpt, tmp_path_factory.mktemp("eval_early"))


def test_metrics_json_has_every_figure_with_n_and_the_checkpoint_identity(run, late):
    record, out = late
    _, _, last = run
    saved = json.loads((out / "metrics.json").read_text())
    assert saved["checkpoint"]["sha256"] == file_sha256(last)
    assert saved["checkpoint"]["global_step"] == 40 and saved["checkpoint"]["kind"] == "diffusion"
    expected = {"diversity_ms_ssim_generated", "diversity_ms_ssim_real", "ssim", "psnr", "ms_ssim",
                "lesion_contrast_generated", "lesion_contrast_real", "mmd_histogram", "frechet_random_resnet10",
                "anatomy_sharpness", "anatomy_tissue_distance", "ventricle_voxels_generated",
                "ventricle_voxels_real", "nearest_training_generated", "nearest_training_real",
                "nearest_training_copies"}
    assert set(saved["figures"]) == expected
    for name, f in saved["figures"].items():
        assert np.isfinite(f["value"]), name
        assert ("n" in f) or ("n_generated" in f and "n_real" in f), name
        assert f["direction"] in ("higher", "lower", "match", "info") and f["definition"], name
    assert saved["figures"]["diversity_ms_ssim_generated"]["pairs"] == 6  # 4 samples
    sharpness = saved["figures"]["anatomy_sharpness"]  # generated ÷ real, both sets' figures beside it
    assert sharpness["value"] == pytest.approx(sharpness["generated"]["value"] / sharpness["real"]["value"])
    assert len(saved["figures"]["ventricle_voxels_real"]["per_volume"]) == 2  # the phantom's: real ventricles
    assert saved["figures"]["ventricle_voxels_real"]["value"] > 0
    assert saved["n_generated"] == 4 and saved["n_real"] == 2  # 6 phantom subjects: 2 validation
    nearest = saved["figures"]["nearest_training_real"]  # each held-out image's nearest of the 4 training images
    assert nearest["measure"] == "pearson" and nearest["training_volumes"] == 4
    assert not set(nearest["subjects"]) & set(saved["real_subjects"]) and len(set(nearest["subjects"])) >= 1
    assert saved["sampling"]["num_inference_steps"] == 5 and saved["sampling"]["use_ema"] is True
    assert "never downloads" in saved["absent"]["medicalnet"]
    assert saved["metric_settings"]["ms_ssim"]["kernel_size"] == 5
    assert saved["metric_settings"]["ms_ssim"]["preset"] == "voxdiff"
    assert record["html"] == str(out / "report.html")


#: the figures of volumes that carry a bootstrap interval (the Fréchet distance and the MMD do not)
WITH_INTERVAL = {"diversity_ms_ssim_generated", "diversity_ms_ssim_real", "ssim", "psnr", "ms_ssim",
                 "lesion_contrast_generated", "lesion_contrast_real", "anatomy_sharpness", "anatomy_tissue_distance",
                 "ventricle_voxels_generated", "ventricle_voxels_real"}


def test_each_figure_of_volumes_carries_its_bootstrap_interval_where_both_sets_are_large_enough(run, late, tmp_path,
                                                                                                capsys):
    """Every subject of the run (6 real) and 6 samples: each figure averaged over volumes has its interval, seeded
    (the same evaluation again gives the same bounds) and shown in the report; the distribution figures have none,
    and say why in metrics.json. The plain evaluation (2 real volumes) is below the smallest set an interval is
    drawn for: none there."""
    _, _, last = run
    record = _evaluate(last, tmp_path / "a", "split=all", "n=6", "bootstrap.resamples=200")
    figures = record["figures"]
    # 200 resamples at the level widened for 6 volumes: a few beyond each bound, and the command says what steadies
    tails = [f["ci_tail_resamples"] for f in figures.values() if "ci" in f]
    assert tails and max(tails) < 20
    assert re.search(r"note: \d+ interval\(s\) rest on as few as .* bootstrap.resamples=\d+ steadies them",
                     capsys.readouterr().out)
    for name in WITH_INTERVAL:
        f = figures[name]
        low, high = f["ci"]
        assert low <= high and f["ci_level"] == 0.95 and f["se"] >= 0, name
        assert f["ci_expanded_by"] > 1.1, name  # sets of 6: √(6/5) and t with 5 to 10 df, 1.24-1.44
        if name not in ("anatomy_tissue_distance",):  # a distance's resamples lie above it when the sets are alike
            assert low <= f["value"] <= high, name
    assert not any("ci" in figures[name] for name in set(figures) - WITH_INTERVAL)
    assert "split=all" in record["absent"]["nearest_training"]  # every subject is in the real set: none held out
    settings = record["metric_settings"]["bootstrap"]
    assert (settings["resamples"], settings["level"], settings["method"], settings["seed"]) == (200, 0.95,
                                                                                               "percentile", 0)
    assert settings["expand"] is True and "Welch-Satterthwaite" in settings["expanded"]
    assert "mmd_histogram" in settings["not_bootstrapped"] and "frechet_*" in settings["not_bootstrapped"]
    again = _evaluate(last, tmp_path / "b", "split=all", "n=6", "bootstrap.resamples=200", "seed=0")
    assert again["figures"]["psnr"]["ci"] == figures["psnr"]["ci"]
    psnr = figures["psnr"]
    page = Path(record["html"]).read_text()
    assert "interval (bootstrap over volumes)" in page and "widened for the sets' sizes" in page
    assert f"[{psnr['ci'][0]:.4g}, {psnr['ci'][1]:.4g}] (95%)" in page
    assert render(Path(record["html"]), tmp_path / "page.png")["table_rows"] == len(figures)
    plain = late[0]
    assert not any("ci" in f for f in plain["figures"].values())  # 2 real volumes: fewer than an interval needs
    assert plain["metric_settings"]["bootstrap"]["min_volumes"] > 2
    without = _evaluate(last, tmp_path / "c", "split=all", "n=6", "bootstrap.resamples=0")
    assert without["metric_settings"]["bootstrap"] is None and not any("ci" in f for f in without["figures"].values())


def test_samples_carry_the_source_affine(late):
    _, out = late
    files = sorted((out / "samples").glob("*_generated.nii.gz"))
    assert len(files) == 4
    img = nib.load(files[0])
    assert img.shape == SHAPE
    np.testing.assert_allclose(img.affine, np.eye(4))  # the phantom's identity affine, as the data module gives


def test_the_report_renders_in_a_real_browser(late, tmp_path):
    record, out = late
    page = (out / "report.html").read_text()
    assert "http://" not in page and "https://" not in page and "<script" not in page  # offline, self-contained
    result = render(out / "report.html", tmp_path / "report.png")
    # 2 montages, the histograms and the loss curve, each decoded by the browser
    assert len(result["image_widths"]) == 4 and min(result["image_widths"]) > 100
    assert result["table_rows"] == len(record["figures"])
    assert result["blank"] is False  # the screenshot shows the page, not an empty canvas


def test_an_autoguided_evaluation_records_its_guide_and_samples_otherwise(run, late, tmp_path):
    """``autoguide_scale`` with a guide (here the run's step-2 checkpoint: the same network, less trained) changes the
    samples, and ``metrics.json`` records the scale and the guide; the plain evaluation records scale 1 (the run
    asks for 1.25 by default, as the demo does, but ended before its guide snapshot at step 200)."""
    _, early_ckpt, last = run
    guided = _evaluate(last, tmp_path, "autoguide_scale=1.5", f"autoguide_ckpt={early_ckpt}")
    plain = json.loads((late[1] / "metrics.json").read_text())
    saved = json.loads((tmp_path / "metrics.json").read_text())
    assert (saved["sampling"]["autoguide_scale"], saved["sampling"]["autoguide_ckpt"]) == (1.5, str(early_ckpt))
    assert plain["sampling"]["autoguide_scale"] == 1.0 and "autoguide_ckpt" not in plain["sampling"]
    assert saved["sampling"]["conditioned_on"] == plain["sampling"]["conditioned_on"]  # same masks, same noise
    # the predicted memory is recorded (measured only on a GPU): the guide's UNet is on the device too
    assert set(plain["sampling"]["memory_gib"]) == {"predicted"}
    assert saved["sampling"]["memory_gib"]["predicted"] > plain["sampling"]["memory_gib"]["predicted"] > 0
    assert saved["figures"]["psnr"]["value"] != plain["figures"]["psnr"]["value"]
    assert guided is not None


def test_figures_move_the_right_way_from_an_early_to_a_late_checkpoint(early, late):
    e, l = early["figures"], late[0]["figures"]
    assert early["checkpoint"]["global_step"] == 2
    assert l["psnr"]["value"] > e["psnr"]["value"]
    assert l["ssim"]["value"] > e["ssim"]["value"]
    assert l["ms_ssim"]["value"] > e["ms_ssim"]["value"]
    real = l["lesion_contrast_real"]["value"]  # the lesion's contrast comes closer to the real one
    assert abs(l["lesion_contrast_generated"]["value"] - real) < abs(e["lesion_contrast_generated"]["value"] - real)
    assert l["mmd_histogram"]["value"] < e["mmd_histogram"]["value"]
    assert l["frechet_random_resnet10"]["value"] < e["frechet_random_resnet10"]["value"]


@pytest.fixture(scope="module")
def seg_run(tmp_path_factory):
    """40 steps of the tiny model drawing masks alone (``mode=seg``)."""
    out = tmp_path_factory.mktemp("seg")
    return Path(train(compose("train", [*TINY, "mode=seg", f"paths.output_dir={out}"]))["last_checkpoint"])


def test_a_mask_model_is_evaluated_on_its_lesions_and_their_nearest_training_masks(seg_run, tmp_path, capsys):
    """A mask model's evaluation: the lesions of its masks against the real ones (count, load, size, placement) and
    each mask's nearest training mask by Dice, beside the distribution figures; no paired or
    anatomy figure (no image). The real masks' counts are the phantom's 1-4 lesions; the page renders each figure."""
    record = _evaluate(seg_run, tmp_path)
    # the read of the training split is announced with its time at the phantom loader's measured rate
    out = capsys.readouterr().out
    assert re.search(r"reading the 4 subjects of the training split, about \d+ s at the measured", out), out
    saved = json.loads((tmp_path / "metrics.json").read_text())
    figures = saved["figures"]
    lesions = {f"lesion_{k}_{of}" for k in ("count", "load", "size", "outside_head") for of in ("generated", "real")}
    denoising = {"denoised_dice_t01", "denoised_dice_t05", "denoised_dice_t20", "denoised_dice_t50"}
    assert set(figures) == {"diversity_ms_ssim_generated", "diversity_ms_ssim_real", "mmd_histogram",
                            "frechet_random_resnet10", "nearest_training_generated",
                            "nearest_training_real", "nearest_training_copies", *lesions, *denoising}
    # the demo's mask weight (20) is undone as the model samples and as it denoises the real masks
    assert saved["sampling"]["mask_weight_undone"] == 20.0
    for name in denoising:  # each real mask (the phantom's all have lesions) shown at 1, 5, 20 and 50% noise
        assert len(figures[name]["per_mask"]) == len(saved["real_subjects"]) == figures[name]["n"]
        assert 0 <= figures[name]["value"] <= 1
        assert figures[name]["lesion_load_ratio"] >= 0
    assert saved["checkpoint"]["mode"] == "seg" and "anatomy" in saved["absent"]
    assert all(1 <= c <= 4 for c in figures["lesion_count_real"]["per_mask"])
    assert figures["lesion_load_real"]["value"] > 0 and figures["lesion_outside_head_real"]["value"] == 0
    counts = figures["lesion_count_generated"]["per_mask"]  # an undertrained model may draw empty masks
    assert len(counts) == 4 and figures["lesion_count_generated"]["value"] == pytest.approx(sum(counts) / 4)
    assert math.isnan(figures["lesion_size_generated"]["value"]) == (sum(counts) == 0)  # no lesion: no size
    assert [math.isnan(v) for v in figures["nearest_training_generated"]["per_volume"]] == [c == 0 for c in counts]
    nearest = figures["nearest_training_real"]
    assert nearest["measure"] == "dice" and nearest["training_volumes"] == 4 and 0 <= nearest["value"] <= 1
    assert not set(nearest["subjects"]) & set(saved["real_subjects"])  # held out: never its own subject
    for of in ("generated", "real"):  # every lesion counted falls in one size band of the lesion figure
        bands = figures[f"lesion_size_{of}"]["size_histogram"]
        assert sum(bands["lesions"]) == figures[f"lesion_size_{of}"]["lesions"] == sum(
            figures[f"lesion_count_{of}"]["per_mask"])
        assert len(bands["edges"]) == len(bands["lesions"]) + 1
    page = Path(record["html"]).read_text()
    assert "Lesions: real vs generated masks" in page and "Intensity histograms" not in page
    shown = render(Path(record["html"]), tmp_path / "page.png")
    assert shown["table_rows"] == len(figures)
    assert len(shown["image_widths"]) == page.count("<img") and all(w > 0 for w in shown["image_widths"])
    off = _evaluate(seg_run, tmp_path / "off", "nearest_training=false")
    assert not any(name.startswith("nearest_training") for name in off["figures"])
    assert "nearest_training=false" in off["absent"]["nearest_training"]
    drawn = off["figures"]["lesion_count_generated"]  # the same masks drawn: the same lesions
    assert drawn["per_mask"] == figures["lesion_count_generated"]["per_mask"]
    weighted = _evaluate(seg_run, tmp_path / "weighted", "nearest_training=false", "unweight=false")
    assert weighted["sampling"]["mask_weight_undone"] == 0.0
    for name in denoising:  # the same noise: undoing the weight only lowers each voxel's lesion probability
        assert weighted["figures"][name]["lesion_load_ratio"] >= figures[name]["lesion_load_ratio"]
    # both in one sweep: each evaluation the one made alone (the same masks and noise), side by side
    both = _evaluate(seg_run, tmp_path / "both", "nearest_training=false", "unweight=[true,false]")
    assert both["swept"] == "unweight" and both["values"] == ["true", "false"]
    for value, alone in (("true", off), ("false", weighted)):
        one = json.loads((tmp_path / "both" / f"unweight_{value}" / "metrics.json").read_text())
        assert one["sampling"]["mask_weight_undone"] == alone["sampling"]["mask_weight_undone"]
        for name, f in alone["figures"].items():
            assert one["figures"][name]["value"] == pytest.approx(f["value"], nan_ok=True), (value, name)
            assert both["figures"][name]["values"][both["values"].index(value)] == pytest.approx(
                f["value"], nan_ok=True), (value, name)
    assert "unweight_true/report.html" in (tmp_path / "both" / "sweep.html").read_text()


def test_a_sweep_of_unweight_on_a_model_without_a_mask_weight_is_refused_before_it_samples(run, tmp_path):
    """A bravo model has no mask weight to undo: ``unweight=[true,false]`` would evaluate it twice alike, so it is
    refused naming ``unweight``, before anything is sampled."""
    _, _, last = run
    with pytest.raises(ConfigError, match=r"unweight=true and unweight=false sample .* alike: it has no mask weight "
                                          r"to undo .* Fix: evaluate it once, without unweight given as a list") as e:
        _evaluate(last, tmp_path, "unweight=[true,false]")
    assert e.value.key == "unweight"
    assert not (tmp_path / "unweight_true").exists()


@pytest.fixture(scope="module")
def stage1(tmp_path_factory):
    """A 2-step VQ-VAE run's last checkpoint and its evaluation."""
    out = tmp_path_factory.mktemp("stage1")
    report = train(compose("train", [
        "experiment=vqvae_demo", *QUIET, f"paths.output_dir={out / 'run'}", "data.volume_shape=[24,32,32]",
        "data.num_subjects=3", "system.vqvae.channels=[8,8]", "system.vqvae.num_res_channels=8",
        "system.vqvae.num_res_layers=1", "system.vqvae.num_embeddings=16", "trainer.max_steps=2"]))
    return Path(report["last_checkpoint"]), _evaluate(report["last_checkpoint"], out / "eval", "n=2"), out / "eval"


def test_a_vqvae_checkpoint_is_evaluated_on_its_reconstructions(stage1):
    _, record, out = stage1
    f = record["figures"]
    assert record["checkpoint"]["kind"] == "vqvae"
    assert {"reconstruction_ssim", "reconstruction_psnr", "reconstruction_ms_ssim", "codebook_perplexity",
            "codebook_dead_codes"} == set(f)
    usage = f["codebook_perplexity"]
    assert 1.0 <= usage["value"] <= 16 and usage["used"] + usage["dead"] == 16
    assert record["n_real"] == 1  # 3 subjects: 1 validation subject
    assert usage["n_latents"] == 2 * 6 * 8 * 8  # its image and mask, 24x32x32 / 4
    assert (out / "report.html").is_file()


def test_a_stage1_checkpoint_without_a_recorded_kind_is_evaluated_as_before(stage1, without_kind, tmp_path):
    """Compatibility: a stage-1 checkpoint written before the kind was recorded gets the same report."""
    ckpt, record, _ = stage1
    old = _evaluate(without_kind(ckpt, tmp_path / "old.ckpt"), tmp_path / "eval", "n=2")
    assert old["checkpoint"]["kind"] == "vqvae" and old["checkpoint"]["sha256"] != record["checkpoint"]["sha256"]
    assert old["figures"] == record["figures"] and old["n_real"] == record["n_real"]


def test_a_vqvae_evaluation_predicts_its_memory_chooses_auto_and_refuses_what_does_not_fit(stage1, tmp_path,
                                                                                          capsys):
    """The reconstructions' device memory is predicted before the weights move
    (voxdiff.preflight.stage1.predict_reconstruction), as sampling's is: ``batch_size=auto`` takes the largest
    batch predicted to fit, a batch above the budget is refused naming ``batch_size`` with the one that fits, a
    budget not even one volume fits is refused naming ``device``, before any montage; the figures do not depend on
    the batch."""
    ckpt, record, _ = stage1
    assert record["reconstruction"]["batch_size"] == 2  # the configured batch: n=2 of the one validation subject
    spec, volume = read_stage1_checkpoint(ckpt).spec, (24, 32, 32)
    one, two = (predict_reconstruction(spec, b, volume, "cpu").required_bytes() for b in (1, 2))
    assert one < two
    # split=all: 3 subjects; auto on the CPU takes the largest of n=3 that the host's available memory holds
    auto = _evaluate(ckpt, tmp_path / "auto", "n=3", "split=all", "batch_size=auto")
    assert "[voxdiff] batch_size=auto: 3, the largest of at most 3 predicted to fit" in capsys.readouterr().out
    assert auto["reconstruction"]["batch_size"] == 3
    assert auto["reconstruction"]["memory_gib"]["predicted"] == pytest.approx(
        predict_reconstruction(spec, 3, volume, "cpu").peak / 2**30, abs=1e-4)
    # a budget between one volume's need and two's: auto takes 1, an explicit 2 is refused naming batch_size
    budget = f"memory_budget_gib={(one + two) / 2 / 2**30}"
    small = _evaluate(ckpt, tmp_path / "small", "n=2", "split=all", "batch_size=auto", budget)
    assert small["reconstruction"]["batch_size"] == 1
    assert small["figures"]["codebook_perplexity"] == _evaluate(
        ckpt, tmp_path / "two", "n=2", "split=all", "batch_size=2")["figures"]["codebook_perplexity"]
    with pytest.raises(ConfigError, match=r"batch_size=2: reconstruction is predicted to need .* Fix: use "
                                          r"batch_size=1 \(predicted"):
        _evaluate(ckpt, tmp_path / "refused", "n=2", "split=all", "batch_size=2", budget)
    with pytest.raises(ConfigError) as e:
        _evaluate(ckpt, tmp_path / "none", "n=2", "batch_size=1", "memory_budget_gib=1e-9")
    assert e.value.key == "device" and "reconstructing one volume of 24x32x32" in str(e.value)
    assert not (tmp_path / "none" / "samples").exists() and not (tmp_path / "none" / "metrics.json").exists()


def test_the_report_follows_the_recorded_kind(stage1, tmp_path):
    """A stage 1's weights and keys under a recorded diffusion kind are evaluated as a diffusion checkpoint (and
    refused: its hyper-parameters build no UNet), not guessed from its keys; a file of no kind is refused."""
    import torch

    ckpt, _, _ = stage1
    data = torch.load(ckpt, weights_only=True)
    data["hyper_parameters"]["kind"] = "diffusion"
    torch.save(data, tmp_path / "relabelled.ckpt")
    with pytest.raises(ConfigError) as err:
        _evaluate(tmp_path / "relabelled.ckpt", tmp_path / "eval", "n=2")
    assert err.value.key == "ckpt_path" and "which DiffusionSystem needs" in str(err.value)
    data["hyper_parameters"] = {"lr": 1e-3}
    torch.save(data, tmp_path / "other.ckpt")
    with pytest.raises(ConfigError) as err:
        _evaluate(tmp_path / "other.ckpt", tmp_path / "eval", "n=2")
    assert err.value.key == "ckpt_path" and "is not a checkpoint of voxdiff's train.py" in str(err.value)
    assert ("evaluate.py needs a diffusion-UNet checkpoint (DiffusionSystem, system=diffusion) or a VQ-VAE stage-1 "
            "checkpoint (VQVAESystem, system=vqvae)") in str(err.value)
    assert not (tmp_path / "eval").exists()


def test_the_loss_curve_comes_from_the_runs_csv(run, tmp_path):
    from voxdiff.evaluation.report import read_loss_log

    out, _, _ = run
    series = read_loss_log(out)
    steps = [s for s, _ in series["train/loss"]]
    assert steps == sorted(steps) and steps[-1] >= 38 and len(series["val/loss"]) >= 1
    assert read_loss_log(tmp_path) == {}  # no csv/ folder: the report says the curve is absent


@pytest.mark.parametrize("override, key", [
    ("n=1", "n"), ("montages=-1", "montages"), ("random_features_seed=-2", "random_features_seed"),
    ("stage1_ckpt=/nonexistent.ckpt", "stage1_ckpt"), ("ms_ssim=hagan", "ms_ssim"),
    ("medicalnet.weights=/some.pth", "medicalnet.sha256"), ("diversity_pairs=0", "diversity_pairs"),
    ("batch_size=many", "batch_size"), ("memory_budget_gib=-1", "memory_budget_gib"),
    # a sweep: each value as one evaluation, at least two, none twice, one scale at a time
    ("autoguide_scale=[1,-1]", "autoguide_scale"), ("autoguide_scale=[1.5]", "autoguide_scale"),
    ("guidance_scale=[1,2,1]", "guidance_scale"), ("guidance_scale=[1,x]", "guidance_scale"),
    ("autoguide_scale=[1,1.5] guidance_scale=[1,2]", "autoguide_scale"),
    # a comparison: each checkpoint a file, at least two, one list at a time
    ("ckpt_path=[/nonexistent/a.ckpt,/nonexistent/b.ckpt]", "ckpt_path"),
    ("ckpt_path=[/nonexistent/a.ckpt]", "ckpt_path"),
    ("autoguide_scale=[1,1.5] ckpt_path=[/a.ckpt,/b.ckpt]", "ckpt_path"),
    # the intervals: enough resamples for their tails, a level in (0, 1), SciPy's methods, no other setting
    ("bootstrap.resamples=10", "bootstrap.resamples"), ("bootstrap.resamples=-1", "bootstrap.resamples"),
    ("bootstrap.level=95", "bootstrap.level"), ("bootstrap.method=bayes", "bootstrap.method"),
    ("+bootstrap.seed=3", "bootstrap.seed"), ("bootstrap.expand=yes", "bootstrap.expand"),
    ("nearest_training=maybe", "nearest_training"),
])
def test_bad_evaluation_configs_are_refused(run, override, key):
    _, _, last = run
    with pytest.raises(ConfigError) as e:
        validate(compose("evaluate", [f"ckpt_path={last}", *override.split()]))
    assert e.value.key == key


def test_the_default_output_is_the_runs_eval_folder(run):
    out, _, last = run
    cfg = compose("evaluate", [f"ckpt_path={last}"])
    run_dir = Path(cfg.paths.run_dir)
    assert run_dir.parent == out / "eval" and run_dir.name[:4].isdigit()
    assert compose("evaluate", [f"ckpt_path={last}", "out_dir=/tmp/x"]).paths.run_dir == "/tmp/x"
    compared = Path(compose("evaluate", [f"ckpt_path=[{last},{last}]"]).paths.run_dir)  # two runs may be compared:
    assert compared.parent.name == "evaluate" and compared.parent.parent != out  # under paths.log_dir, no run's


def test_a_comparison_evaluates_each_checkpoint_on_the_same_masks_and_noise_and_reads_them_paired(run, tmp_path,
                                                                                                  capsys):
    """``'ckpt_path=[early,late]'``: each checkpoint a whole evaluation in ``ckpt_<k>/`` with the same masks, noise
    and real volumes; ``sweep.json`` names each by its run, file and step, ranks each figure, and ties by a paired
    bootstrap: 38 more steps of training lift the PSNR by more than its paired interval (step 2's samples are
    noise-like), so the late checkpoint is preferred and the early one not tied with it. The page renders. The
    command's summary prints each label once and names the checkpoints by their numbers."""
    _, early, last = run
    record = _evaluate(f"[{early},{last}]", tmp_path, "split=all", "n=6", "bootstrap.resamples=200")
    printed = capsys.readouterr().out
    psnr = next(line for line in printed.splitlines() if line.startswith("[voxdiff]   psnr: "))
    assert psnr.endswith("(prefers 2)") and " 1: " in psnr and "step002" not in psnr
    assert all(f"[voxdiff]   {label}\n" in printed for label in record["values"])
    assert record["swept"] == "ckpt_path" and record["checkpoint"] is None
    first, second = record["values"]
    assert first.startswith("1: ") and first.endswith("step002.ckpt, step 2")
    assert second.startswith("2: ") and second.endswith("last.ckpt, step 40")
    ones = [json.loads((tmp_path / f"ckpt_{k}" / "metrics.json").read_text()) for k in (1, 2)]
    assert [o["checkpoint"]["sha256"] for o in ones] == [file_sha256(early), file_sha256(last)]
    assert ones[0]["sampling"]["conditioned_on"] == ones[1]["sampling"]["conditioned_on"]
    assert record["sampling"]["conditioned_on"] == ones[0]["sampling"]["conditioned_on"]
    saved = json.loads((tmp_path / "sweep.json").read_text())
    psnr = saved["figures"]["psnr"]
    assert psnr["values"] == [o["figures"]["psnr"]["value"] for o in ones]
    assert psnr["best"] == second and psnr["tie_rule"] == "paired bootstrap" and psnr["tied"] == []
    assert psnr["differences"][first][0] > 0  # the early one's PSNR lower on every bootstrap draw but the tails
    assert [e["checkpoint"]["path"] for e in saved["evaluations"]] == [str(early), str(last)]
    page = render(tmp_path / "sweep.html", tmp_path / "sweep.png")
    assert page["table_rows"] == len(saved["figures"]) and page["blank"] is False
    html = (tmp_path / "sweep.html").read_text()
    assert "href='ckpt_1/report.html'" in html and "href='ckpt_2/report.html'" in html


@pytest.fixture(scope="module")
def reseeded(tmp_path_factory):
    """The run's recipe trained again with another seed: its step-2 and step-40 checkpoints."""
    return _trained(tmp_path_factory.mktemp("reseeded"), "seed=1")


def test_recipes_are_compared_by_the_mean_of_their_runs_each_evaluated_on_the_same_masks(run, reseeded, tmp_path):
    """``'ckpt_path=[[a1,a2],[b1,b2]]'``: two "recipes" (2 and 40 steps), each trained with two seeds; every run a
    whole evaluation in ``recipe_<g>/run_<k>/`` on the same masks and noise; a recipe's figure is its runs' mean,
    each run's value kept; two runs a recipe are too few to resample, so the ties are within one standard error
    of the per-seed differences (the second recipe lists seed 1's run first, and is put in the first's seed
    order: 42, 1) and the page says what the intervals are over. 40 steps draw a higher PSNR in both seeds.
    Refused before anything is evaluated: a recipe of one run, recipes mixed with checkpoints, a repeated run."""
    from voxdiff.evaluation.guidance_sweep import SEEDS_RULE

    _, early, last = run
    early_2, last_2 = reseeded
    record = _evaluate(f"[[{early},{early_2}],[{last_2},{last}]]", tmp_path, "split=all", "n=6",
                       "bootstrap.resamples=200")
    assert record["values"] == ["1: 2 runs (steps, steps; seeds 42, 1)", f"2: 2 runs ({last.parent.parent.name}, "
                                f"{last_2.parent.parent.name}; seeds 42, 1)"]  # in seed order, named with them
    ones = [[json.loads((tmp_path / f"recipe_{g}" / f"run_{k}" / "metrics.json").read_text()) for k in order]
            for g, order in ((1, (1, 2)), (2, (2, 1)))]  # recipe 2's run_1 is seed 1's, as listed
    assert [[o["checkpoint"]["sha256"] for o in g] for g in ones] == [
        [file_sha256(early), file_sha256(early_2)], [file_sha256(last), file_sha256(last_2)]]
    assert len({str(o["sampling"]["conditioned_on"]) for g in ones for o in g}) == 1
    saved = json.loads((tmp_path / "sweep.json").read_text())
    psnr = saved["figures"]["psnr"]
    runs = [[o["figures"]["psnr"]["value"] for o in g] for g in ones]
    assert psnr["runs"] == runs and psnr["values"] == pytest.approx([sum(r) / 2 for r in runs])
    assert min(runs[1]) > max(runs[0]) and psnr["best"] == record["values"][1]
    assert psnr["tie_rule"] == SEEDS_RULE and saved["runs"] == [2, 2] and "fewer than 5" in saved["intervals_over"]
    assert [[o["checkpoint"]["train_seed"] for o in g] for g in ones] == [[42, 1], [42, 1]]
    assert saved["runs_paired_by_seed"] is True  # both recipes' runs in seed order: 42's, then 1's
    assert [e["recipe"] for e in saved["evaluations"]] == [record["values"][0]] * 2 + [record["values"][1]] * 2
    assert [e["checkpoint"]["train_seed"] for e in saved["evaluations"]] == [42, 1, 42, 1]
    page = render(tmp_path / "sweep.html", tmp_path / "sweep.png")
    assert page["table_rows"] == len(saved["figures"]) and page["blank"] is False
    html = (tmp_path / "sweep.html").read_text()
    assert all(f"href='recipe_{g}/run_{k}/report.html'" in html for g in (1, 2) for k in (1, 2))
    assert html.index("href='recipe_2/run_2/report.html'") < html.index("href='recipe_2/run_1/report.html'")
    assert "training runs on these volumes" in html
    for bad, why in ((f"[[{early}],[{last},{last_2}]]", "a recipe of 1 run"),
                     (f"[[{early},{early_2}],{last}]", "mixes recipes"),
                     (f"[[{early},{early_2}],[{last},{early_2}]]", "repeats a value")):
        with pytest.raises(ConfigError, match=re.escape(why)) as e:
            validate(compose("evaluate", [f"ckpt_path={bad}"]))
        assert e.value.key == "ckpt_path"


def test_a_guidance_scale_swept_over_one_recipe_s_runs_evaluates_every_run_at_every_scale(run, reseeded, tmp_path):
    """``'ckpt_path=[[a1,a2]]' 'autoguide_scale=[1,1.5]'``: each of the recipe's two runs (seeds 42 and 1) at each
    scale, in ``autoguide_scale_<s>/run_<k>/``, on the same masks and noise; a scale's figure is the mean of its
    runs', the same runs at both (paired run by run: with two runs the ties are by the per-run differences); the page
    links every run's report under its scale and renders. Refused before anything is sampled: one recipe swept over
    nothing, a recipe of one run, two recipes swept, a run listed twice."""
    from voxdiff.evaluation.guidance_sweep import RUN_PAIRS_RULE

    _, early, last = run
    _, last_2 = reseeded
    record = _evaluate(f"[[{last},{last_2}]]", tmp_path, "autoguide_scale=[1,1.5]", f"autoguide_ckpt={early}",
                       "bootstrap.resamples=200")
    assert record["swept"] == "autoguide_scale" and record["values"] == [1.0, 1.5] and record["same_runs"] is True
    ones = [[json.loads((tmp_path / f"autoguide_scale_{s}" / f"run_{k}" / "metrics.json").read_text())
             for k in (1, 2)] for s in ("1", "1.5")]
    assert [[o["checkpoint"]["sha256"] for o in at] for at in ones] == [[file_sha256(last), file_sha256(last_2)]] * 2
    assert [[o["sampling"]["autoguide_scale"] for o in at] for at in ones] == [[1.0, 1.0], [1.5, 1.5]]
    assert len({str(o["sampling"]["conditioned_on"]) for at in ones for o in at}) == 1
    saved = json.loads((tmp_path / "sweep.json").read_text())
    psnr = saved["figures"]["psnr"]
    runs = [[o["figures"]["psnr"]["value"] for o in at] for at in ones]
    assert psnr["runs"] == runs and psnr["values"] == pytest.approx([sum(r) / 2 for r in runs])
    assert runs[0] != runs[1] and psnr["tie_rule"] == RUN_PAIRS_RULE and saved["checkpoint"] is None
    assert [(e["autoguide_scale"], e["run"]) for e in saved["evaluations"]] == [(1.0, 1), (1.0, 2), (1.5, 1), (1.5, 2)]
    page = render(tmp_path / "sweep.html", tmp_path / "sweep.png")
    assert page["table_rows"] == len(saved["figures"]) and page["blank"] is False
    html = (tmp_path / "sweep.html").read_text()
    assert all(f"href='autoguide_scale_{s}/run_{k}/report.html'" in html for s in ("1", "1.5") for k in (1, 2))
    assert "autoguide_scale=1.5" in html and "the same runs at every value" in html and "seeds 42, 1" in html
    for ckpt, extra, key, why in ((f"[[{last},{last_2}]]", [], "ckpt_path", "lists one recipe and sweeps nothing"),
                                  (f"[[{last}]]", ["autoguide_scale=[1,1.5]"], "ckpt_path", "a recipe of 1 run"),
                                  (f"[[{early},{last}],[{early},{last_2}]]", ["autoguide_scale=[1,1.5]"], "ckpt_path",
                                   "one list at a time"),
                                  (f"[[{last},{last}]]", ["autoguide_scale=[1,1.5]"], "ckpt_path", "repeats a value")):
        with pytest.raises(ConfigError, match=re.escape(why)) as e:
            validate(compose("evaluate", [f"ckpt_path={ckpt}", *extra]))
        assert e.value.key == key


@pytest.mark.parametrize(("key", "values", "refused", "says"), [
    ("num_inference_steps", [2, 5], "[5,5]", "num_inference_steps=[10,25,50]"),  # a repeated count: an example
    ("eta", [0, 1], "[0,1.5]", "eta=1.5"),  # deterministic and ancestral DDIM; an eta above 1
])  # fmt: skip
def test_a_sweep_of_a_sampler_setting_evaluates_each_with_the_same_masks_and_noise(run, tmp_path, key, values,
                                                                                   refused, says):
    """``num_inference_steps=[2,5]`` or ``eta=[0,1]``: one evaluation per value in ``<key>_<value>/``, each recording
    its value, from the same masks (the samples differ: 2 DDIM steps against 5, deterministic against ancestral); a
    list with a value that cannot be swept refused, naming the key."""
    _, _, last = run
    record = _evaluate(last, tmp_path, f"{key}=[{','.join(map(str, values))}]")
    assert record["swept"] == key and record["values"] == [float(v) for v in values]
    ones = [json.loads((tmp_path / f"{key}_{v}" / "metrics.json").read_text()) for v in values]
    assert [o["sampling"][key] for o in ones] == values
    assert ones[0]["sampling"]["conditioned_on"] == ones[1]["sampling"]["conditioned_on"]
    assert ones[0]["figures"]["psnr"]["value"] != ones[1]["figures"]["psnr"]["value"]
    assert f"{key}={values[-1]}" in (tmp_path / "sweep.html").read_text()
    with pytest.raises(ConfigError, match=re.escape(says)) as e:
        validate(compose("evaluate", [f"ckpt_path={last}", f"{key}={refused}"]))
    assert e.value.key == key


def test_a_sweep_of_guidance_intervals_evaluates_each_with_the_same_masks_and_noise(run, tmp_path):
    """``'guidance_interval=[[0,1],[0,0.4]]'`` with autoguidance (the step-2 checkpoint as the guide): one evaluation
    per interval in ``guidance_interval_<lo>-<hi>/``, each recording its interval; guided at 2 of the 5 DDIM steps
    the samples differ from those guided at all 5; ``sweep.json`` holds both as ``[lo, hi]`` labels."""
    _, early, last = run
    record = _evaluate(last, tmp_path, "autoguide_scale=1.5", f"autoguide_ckpt={early}",
                       "guidance_interval=[[0,1],[0,0.4]]")
    assert record["swept"] == "guidance_interval" and record["values"] == ["[0, 1]", "[0, 0.4]"]
    ones = [json.loads((tmp_path / f"guidance_interval_{v}" / "metrics.json").read_text()) for v in ("0-1", "0-0.4")]
    assert [o["sampling"]["guidance_interval"] for o in ones] == [[0.0, 1.0], [0.0, 0.4]]
    assert ones[0]["sampling"]["conditioned_on"] == ones[1]["sampling"]["conditioned_on"]
    assert ones[0]["figures"]["psnr"]["value"] != ones[1]["figures"]["psnr"]["value"]
    saved = json.loads((tmp_path / "sweep.json").read_text())
    assert saved["figures"]["psnr"]["values"] == [o["figures"]["psnr"]["value"] for o in ones]
    assert "guidance_interval=[0, 0.4]" in (tmp_path / "sweep.html").read_text()
    for bad, why in (("[[0,1],[0,1]]", "repeats a value"), ("[[0,1]]", "at least two"), ("[[0,1],[0.5,0.2]]",
                                                                                          "0 <= lo < hi <= 1")):
        with pytest.raises(ConfigError, match=re.escape(why)) as e:
            validate(compose("evaluate", [f"ckpt_path={last}", f"guidance_interval={bad}"]))
        assert e.value.key == "guidance_interval"


def test_a_comparison_refuses_a_checkpoint_that_draws_other_subjects_before_it_samples(run, tmp_path):
    """A checkpoint whose stored data settings split other subjects (here 8 phantom subjects, not 6) would be
    evaluated on other masks: refused, naming it, before it samples; and a list that names one file twice."""
    import torch

    from voxdiff.checkpoint import CONFIG_KEY

    _, _, last = run
    other = tmp_path / "other" / "checkpoints" / "last.ckpt"
    other.parent.mkdir(parents=True)
    checkpoint = torch.load(last, map_location="cpu", weights_only=False)
    checkpoint[CONFIG_KEY]["data"]["num_subjects"] = 8
    torch.save(checkpoint, other)
    with pytest.raises(ConfigError, match="draws its masks from other subjects") as e:
        _evaluate(f"[{last},{other}]", tmp_path / "out", "split=all", "n=6")
    assert e.value.key == "ckpt_path" and str(other) in str(e.value)
    assert (tmp_path / "out" / "ckpt_1" / "metrics.json").is_file()  # the first was evaluated
    assert not (tmp_path / "out" / "ckpt_2" / "samples").exists()  # the second sampled nothing
    with pytest.raises(ConfigError, match="repeats a value") as e:
        validate(compose("evaluate", [f"ckpt_path=[{last},{last}]"]))
    assert e.value.key == "ckpt_path"


def test_an_evaluation_above_its_memory_budget_is_refused_before_it_samples_and_auto_takes_the_largest_batch(
        run, tmp_path):
    """evaluate.py predicts its sampling memory as sample.py does (one check: voxdiff.cli.sample.ready): a budget
    that not even batch 1 fits is refused naming ``device``, before any sample or figure is written."""
    _, _, last = run
    with pytest.raises(ConfigError) as e:
        _evaluate(last, tmp_path, "batch_size=4", "memory_budget_gib=1e-9")
    assert e.value.key == "device" and "even at batch_size=1" in str(e.value)
    assert not (tmp_path / "samples").exists() and not (tmp_path / "metrics.json").exists()
    # batch_size=auto on the CPU: the host's available memory holds all n=4 masks of this tiny model at once,
    # and metrics.json records the batch it chose
    _evaluate(last, tmp_path / "auto", "batch_size=auto", "diversity_pairs=2")
    record = json.loads((tmp_path / "auto" / "metrics.json").read_text())
    assert record["sampling"]["batch_size"] == 4
    # and the diversity over 2 of the 6 pairs of the 4 samples, drawn with the seed: the report says so
    diversity = record["figures"]["diversity_ms_ssim_generated"]
    assert (diversity["pairs"], diversity["all_pairs"], diversity["sampled"]) == (2, 6, True)
    assert "2 of 6 pairs, drawn at random" in (tmp_path / "auto" / "report.html").read_text()


def test_the_volumes_host_memory_is_checked_before_the_real_set_is_loaded(monkeypatch):
    """evaluate.py holds its n generated volumes (float32; twice with a negative control) and the real subjects'
    images and masks in host memory: above what the machine has available it is refused naming n, with the largest
    n that fits."""
    from omegaconf import OmegaConf

    from voxdiff.cli import evaluate as E

    volume, per_volume = (1, 16, 32, 32), 4 * 16 * 32 * 32
    real = 2 * 3 * per_volume  # 3 real subjects, image and mask
    monkeypatch.setattr(E, "available_host_bytes", lambda: 5 * per_volume + real)
    assert E.check_host_memory(OmegaConf.create({"n": 5, "control_ckpt": None}), volume, 3) == 5 * per_volume + real
    with pytest.raises(ConfigError, match=r"n=8: holds .* GiB of volumes in host memory \(0.0625 MiB each: 8 "
                                          r"generated, and 3 real subjects' images and masks\), more than .* Fix: use "
                                          r"n=5 or fewer, or a node with more memory"):
        E.check_host_memory(OmegaConf.create({"n": 8, "control_ckpt": None}), volume, 3)
    with pytest.raises(ConfigError, match=r"twice: the negative control's too.* Fix: use n=2 or fewer"):
        E.check_host_memory(OmegaConf.create({"n": 5, "control_ckpt": "control.ckpt"}), volume, 3)
    monkeypatch.setattr(E, "available_host_bytes", lambda: real)
    with pytest.raises(ConfigError, match=r"Fix: use a node with more memory \(n=2 needs"):
        E.check_host_memory(OmegaConf.create({"n": 2, "control_ckpt": None}), volume, 3)


def test_a_sweep_keeps_the_training_split_it_read_where_it_fits_else_reads_it_again(monkeypatch, capsys):
    """:class:`voxdiff.cli.evaluate.TrainingSplits`: a split read to its end is kept and given again, the same
    chunks, to the next evaluation of the same data; other data, or a split larger than half the host memory
    available, is read again (and the log says which); a split not read to its end is not kept."""
    from types import SimpleNamespace

    import torch
    from voxdiff.cli import evaluate as E

    reads = []

    class Split(list):
        def __getitem__(self, i):
            reads.append(i)
            return super().__getitem__(i)

    volumes = [{"image": torch.full((1, 2, 2, 2), float(i)), "subject": f"s{i}"} for i in range(10)]
    dm = SimpleNamespace(train_dataset=Split(volumes), train_subjects=[v["subject"] for v in volumes], root=None)
    cfg = OmegaConf.create({"split": "val", "nearest_training": True})
    size = 4 * 8 * 10  # float32 bytes of the 10 images of 2×2×2
    splits = E.TrainingSplits()
    monkeypatch.setattr(E, "available_host_bytes", lambda: 2 * size)  # exactly twice the split: kept
    first = list(E._training_volumes(cfg, dm, "bravo", splits, "run a")[0])
    assert [len(s) for _, s in first] == [8, 2] and reads == list(range(10))
    assert "kept in memory for the sweep's other evaluations" in capsys.readouterr().out
    again = list(E._training_volumes(cfg, dm, "bravo", splits, "run a")[0])
    assert reads == list(range(10)) and all(a[0] is b[0] and a[1] == b[1] for a, b in zip(first, again))
    assert "kept in memory)" in capsys.readouterr().out
    list(E._training_volumes(cfg, dm, "bravo", splits, "run b")[0])  # other data: read
    assert len(reads) == 20
    reads.clear()
    monkeypatch.setattr(E, "available_host_bytes", lambda: 2 * size - 1)  # more than half: read again each time
    big = E.TrainingSplits()
    for _ in range(2):
        list(E._training_volumes(cfg, dm, "bravo", big, "run a")[0])
        assert "read again by each of the sweep's evaluations" in capsys.readouterr().out
    assert len(reads) == 20 and not big.kept
    monkeypatch.setattr(E, "available_host_bytes", lambda: 2 * size)
    partial = E.TrainingSplits()
    next(E._training_volumes(cfg, dm, "bravo", partial, "run a")[0])  # one chunk of two: not kept
    assert not partial.kept


def test_a_guidance_sweep_evaluates_each_scale_with_the_same_masks_and_noise_and_puts_them_side_by_side(
        run, late, tmp_path, monkeypatch):
    """``autoguide_scale=[1,1.5,2]``: one whole evaluation per scale in ``autoguide_scale_<v>/``; scale 1 is the plain
    evaluation itself (the same masks and noise: every figure equal to the plain one's), the others differ;
    ``sweep.json`` holds each figure's values in the order of the scales with the scale it prefers, and
    ``sweep.html`` renders in a real browser with a row per figure and each scale's report linked. A scale the
    checkpoint cannot take is refused before anything is sampled. The check reads the checkpoint once for every
    scale and the guide once for both scales that use it (``sample.check_each``), then each evaluation its own:
    seven loads, where checking each scale on its own had made ten. The training split the nearest-training
    figures compare against is read once, by the first scale's evaluation, and kept for the others: each training
    subject is read once, not once a scale, and the held-out masks' nearest training figure is the same at each."""
    from collections import Counter
    from pathlib import Path

    import voxdiff.cli.sample as S
    from voxdiff.data.phantom import PhantomDataset
    from voxdiff.lightning.diffusion import DiffusionSystem

    _, early_ckpt, last = run
    loads, reads = [], Counter()
    load, load_guide, getitem = S._load, DiffusionSystem.load_guide, PhantomDataset.__getitem__
    monkeypatch.setattr(S, "_load", lambda cfg, *a, **k: loads.append(
        ("model", cfg.get("autoguide_scale"), str(cfg.ckpt_path) == str(last))) or load(cfg, *a, **k))
    monkeypatch.setattr(DiffusionSystem, "load_guide", lambda self, path, *a, **k: loads.append(
        ("guide", Path(path) == Path(early_ckpt))) or load_guide(self, path, *a, **k))
    monkeypatch.setattr(PhantomDataset, "__getitem__", lambda self, i: (
        lambda item: reads.update([item["subject"]]) or item)(getitem(self, i)))
    record = _evaluate(last, tmp_path, "autoguide_scale=[1,1.5,2]", f"autoguide_ckpt={early_ckpt}")
    assert loads == [("model", 1, True), ("guide", True),  # the check
                     ("model", 1, True), ("model", 1.5, True), ("guide", True), ("model", 2, True), ("guide", True)], \
        loads
    held_out = json.loads((tmp_path / "autoguide_scale_1" / "metrics.json").read_text())["real_subjects"]
    training = {s: k for s, k in reads.items() if s not in held_out}
    assert len(training) == 4 and set(training.values()) == {1}, reads  # 6 phantom subjects, 2 held out
    plain = late[0]
    assert record["swept"] == "autoguide_scale" and record["values"] == [1.0, 1.5, 2.0]
    saved = json.loads((tmp_path / "sweep.json").read_text())
    assert saved["values"] == [1.0, 1.5, 2.0] and set(saved["figures"]) == set(plain["figures"])
    for value in ("1", "1.5", "2"):
        one = json.loads((tmp_path / f"autoguide_scale_{value}" / "metrics.json").read_text())
        assert one["sampling"]["autoguide_scale"] == float(value)
        assert one["sampling"]["conditioned_on"] == plain["sampling"]["conditioned_on"]
        assert (tmp_path / f"autoguide_scale_{value}" / "report.html").is_file()
        for name, f in saved["figures"].items():
            assert f["values"][saved["values"].index(float(value))] == one["figures"][name]["value"], name
    for name, f in saved["figures"].items():  # scale 1 is the plain evaluation, with the same noise
        assert f["values"][0] == pytest.approx(plain["figures"][name]["value"]), name
    assert saved["figures"]["psnr"]["values"][1] != saved["figures"]["psnr"]["values"][0]
    nearest = saved["figures"]["nearest_training_real"]["values"]
    assert nearest == [nearest[0]] * 3 and np.isfinite(nearest[0]), nearest
    psnr, contrast = saved["figures"]["psnr"], saved["figures"]["lesion_contrast_generated"]
    assert psnr["best"] == saved["values"][psnr["values"].index(max(psnr["values"]))]
    real = saved["figures"]["lesion_contrast_real"]
    assert real["best"] is None and contrast["target"] == real["values"][0]
    gaps = [abs(v - contrast["target"]) for v in contrast["values"]]
    assert contrast["best"] == saved["values"][gaps.index(min(gaps))]
    page = render(tmp_path / "sweep.html", tmp_path / "sweep.png")
    assert page["table_rows"] == len(saved["figures"]) and page["blank"] is False
    assert len(page["image_widths"]) == 1 and page["image_widths"][0] > 100
    html = (tmp_path / "sweep.html").read_text()
    assert all(f"href='autoguide_scale_{v}/report.html'" in html for v in ("1", "1.5", "2"))
    # a scale this checkpoint cannot sample with is refused before the first is sampled: no guide for 1.5 here
    with pytest.raises(ConfigError, match=r"autoguide_ckpt=null: autoguide_scale=1.5 needs a guide"):
        _evaluate(last, tmp_path / "refused", "autoguide_scale=[1,1.5]")
    assert not (tmp_path / "refused" / "autoguide_scale_1").exists()


def test_a_mask_model_is_denoised_at_its_subjects_own_covariates_else_at_those_asked_for():
    """evaluate.py's denoising of real masks conditions a covariate model on each subject's own values; where the
    table lacks them (a data folder's table is not read when every covariate is asked for) on the values asked for;
    where neither gives every value, it says why and denoises nothing. An image model is not denoised."""
    from types import SimpleNamespace

    import torch
    from voxdiff.cli.evaluate import _denoised
    from voxdiff.data.covariates import fit_encoding
    from voxdiff.evaluation.pipeline import DENOISE_AT, VolumeSet
    from voxdiff.step.sampling import SamplerChoice

    table = {"a": {"age": "40"}, "b": {"age": "60"}}
    encoding = fit_encoding(table, "participants.tsv", [("age", None)], ["a", "b"], [])
    seen = []

    def denoised(batch, fraction, generator, covariates=None, unweight=True):
        seen.append((fraction, covariates.clone(), unweight))
        return batch["mask"]

    system = SimpleNamespace(mode="seg", covariate_encoding=encoding, step=SimpleNamespace(denoised=denoised))
    real = VolumeSet(torch.zeros(2, 1, 2, 2, 2), torch.zeros(2, 1, 2, 2, 2), torch.eye(4).expand(2, 4, 4), ["a", "b"])
    cfg = OmegaConf.create({"batch_size": 1, "seed": 0})
    sampler = SamplerChoice("DDIM", 2, 0.0, 1.0, mask_weight_undone=20.0)
    precision = SimpleNamespace(autocast=contextlib.nullcontext)
    out, why = _denoised(cfg, system, sampler, real, "cpu", precision, table, {})
    assert why is None and set(out) == set(DENOISE_AT) and out[0.05].shape == (2, 1, 2, 2, 2)
    own = [encoding.vector({"age": v}) for v in (40.0, 60.0)]
    assert all(torch.equal(c[0], own[i % 2]) and undo for i, (_, c, undo) in enumerate(seen))
    seen.clear()
    out, why = _denoised(cfg, system, sampler, real, "cpu", precision, {}, {"age": 50.0})
    assert why is None and torch.equal(seen[0][1][0], encoding.vector({"age": 50.0}))
    out, why = _denoised(cfg, system, sampler, real, "cpu", precision, {}, {})
    assert out is None and "covariates.age" in why and "none was denoised" in why
    assert _denoised(cfg, SimpleNamespace(mode="bravo"), sampler, real, "cpu", precision, table, {}) == (None, None)


def test_a_denoising_fraction_added_at_the_end_leaves_the_others_noise_as_it_was(monkeypatch):
    """Each fraction of DENOISE_AT is noised from a seed of its place in the tuple, so the 1% added in session 46
    (at the end) leaves the 5, 20 and 50% figures that earlier evaluations reported drawn from the same noise; the
    fractions come out in the order of the noise, as the report lists them."""
    from types import SimpleNamespace

    import torch
    import voxdiff.cli.evaluate as E
    from voxdiff.evaluation.pipeline import DEFINITIONS, VolumeSet
    from voxdiff.step.sampling import SamplerChoice

    def denoised(batch, fraction, generator, covariates=None, unweight=True):  # the noise it was given, as a mask
        return (torch.rand(batch["mask"].shape, generator=generator) > 0.5).float()

    system = SimpleNamespace(mode="seg", covariate_encoding=None, step=SimpleNamespace(denoised=denoised))
    real = VolumeSet(torch.zeros(2, 1, 3, 3, 3), torch.zeros(2, 1, 3, 3, 3), torch.eye(4).expand(2, 4, 4), ["a", "b"])
    cfg = OmegaConf.create({"batch_size": 1, "seed": 3})
    args = (SamplerChoice("Euler", 2, 0.0, 1.0), real, "cpu", SimpleNamespace(autocast=contextlib.nullcontext), {}, {})
    now, _ = E._denoised(cfg, system, *args)
    monkeypatch.setattr(E, "DENOISE_AT", (0.05, 0.2, 0.5))  # before session 46
    before, _ = E._denoised(cfg, system, *args)
    assert list(now) == [0.01, 0.05, 0.2, 0.5]
    assert all(torch.equal(now[f], before[f]) for f in before)
    assert not torch.equal(now[0.01], now[0.05]) and not torch.equal(now[0.05], now[0.2])
    names = [n for n in DEFINITIONS if n.startswith("denoised_dice_t")]
    assert names == ["denoised_dice_t01", "denoised_dice_t05", "denoised_dice_t20", "denoised_dice_t50"]
