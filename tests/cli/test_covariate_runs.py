"""Covariates end to end on the CPU (issue 28): a NIfTI folder with a BIDS ``participants.tsv`` trains, its encoding
is the training split's and travels in the checkpoint; ``sample.py`` samples at requested values (the rest from
each subject's row, or without the table when every value is requested) and writes them beside each volume;
``evaluate.py`` reports whether age is obeyed, with a negative control; resume refuses another covariate list."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import torch

from voxdiff.cli.evaluate import evaluate
from voxdiff.cli.sample import sample
from voxdiff.cli.train import train
from voxdiff.config import compose
from voxdiff.data.covariates import write_table
from voxdiff.data.split import split_subjects
from voxdiff.errors import ConfigError
from voxdiff.lightning.resume import check_resume

NAMES = [f"sub-{i:02d}" for i in range(4)]
AGES = [31.0, 47.0, 58.0, 72.0]
SEXES = ["F", "M", "M", "F"]


def _nifti_folder(root: Path, table: bool = True) -> Path:
    """Four 16³ subjects (``bravo.nii.gz``, ``seg.nii.gz``) and their ``participants.tsv`` (age, sex, site)."""
    rng = np.random.default_rng(0)
    for name in NAMES:
        (root / name).mkdir(parents=True)
        mask = np.zeros((16, 16, 16), np.float32)
        mask[5:9, 5:9, 5:9] = 1
        nib.save(nib.Nifti1Image(rng.uniform(10, 100, (16, 16, 16)).astype(np.float32), np.eye(4)),
                 str(root / name / "bravo.nii.gz"))
        nib.save(nib.Nifti1Image(mask, np.eye(4)), str(root / name / "seg.nii.gz"))
    if table:
        write_table(root / "participants.tsv", {n: {"participant_id": n, "age": str(a), "sex": s, "site": "A"}
                                                 for n, a, s in zip(NAMES, AGES, SEXES, strict=True)})
    return root


@pytest.fixture(scope="module")
def nifti_run(tmp_path_factory, tiny_demo) -> tuple[Path, Path]:
    root = _nifti_folder(tmp_path_factory.mktemp("bids"))
    out = tmp_path_factory.mktemp("nifti_covariate_run")
    report = train(compose("train", [*tiny_demo, f"data.root={root}", "data.covariates=[age,sex]",
                                     f"paths.output_dir={out}"]))
    return root, Path(report["last_checkpoint"])


def _sidecars(folder: Path) -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in sorted(folder.glob("*_covariates.json"))}


def test_a_nifti_folder_with_participants_tsv_trains_with_the_training_splits_encoding(nifti_run) -> None:
    root, ckpt = nifti_run
    stored = torch.load(ckpt, map_location="cpu", weights_only=True)
    train_idx, _ = split_subjects(NAMES, 0.25, 0)
    ages = np.array([AGES[i] for i in train_idx])
    age, sex = stored["hyper_parameters"]["covariates"]["columns"]
    assert age["kind"] == "numeric" and age["mean"] == pytest.approx(ages.mean())
    assert age["std"] == pytest.approx(ages.std()) and (age["min"], age["max"]) == (ages.min(), ages.max())
    assert sex == {"name": "sex", "kind": "categorical", "levels": sorted({SEXES[i] for i in train_idx})}
    assert stored["state_dict"]["model.class_embedding.mlp.0.weight"].shape[1] == 1 + len(sex["levels"]) + 1


def test_the_preflight_counts_the_tables_levels_as_the_run_fits_them(nifti_run, tiny_demo) -> None:
    """The preflight's UNet has the covariate width the run trained with: one entry per training level of a
    categorical column, read from the table (without the table, one entry per column: 3 here, not 4)."""
    from voxdiff.data.covariates import estimated_width
    from voxdiff.run.spec import run_spec

    root, ckpt = nifti_run
    trained = torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"]
    width = trained["model.class_embedding.mlp.0.weight"].shape[1]
    run = run_spec(compose("preflight", [*tiny_demo, f"data.root={root}", "data.covariates=[age,sex]"]), "cpu")
    assert run.unet.covariate_dim == width == 4
    assert estimated_width(["age", "sex"], phantom=False) == 3


def test_sample_takes_requested_values_and_the_rest_from_each_subjects_row(nifti_run, tmp_path) -> None:
    root, ckpt = nifti_run
    age = json.loads(json.dumps(torch.load(ckpt, map_location="cpu", weights_only=True)["hyper_parameters"]
                                ["covariates"]["columns"][0]))
    requested = round((age["min"] + age["max"]) / 2, 1)
    out = tmp_path / "requested"
    sample(compose("sample", [f"ckpt_path={ckpt}", "n=4", "split=all", "num_inference_steps=2",
                              f"covariates.age={requested}",
                              f"data.root={root}", f"paths.output_dir={out}"]))
    sidecars = _sidecars(out / "samples")
    assert len(sidecars) == 4 and len(list((out / "samples").glob("*_generated.nii.gz"))) == 4
    for name, side in sidecars.items():
        subject = side["subject"]
        assert side["covariates"] == {"age": requested, "sex": SEXES[NAMES.index(subject)]}, name
    # every value requested: a folder without a participants table samples (the table is not read)
    bare = _nifti_folder(tmp_path / "bare", table=False)
    out = tmp_path / "all_requested"
    sample(compose("sample", [f"ckpt_path={ckpt}", "n=1", "num_inference_steps=2",
                              f"covariates.age={requested}", "covariates.sex=F",
                              f"data.root={bare}", f"paths.output_dir={out}"]))
    assert [s["covariates"] for s in _sidecars(out / "samples").values()] == [{"age": requested, "sex": "F"}]


def test_sample_at_two_ages_with_one_seed_draws_the_same_noise(covariate_ckpt, tmp_path) -> None:
    """Counterfactuals by hand: two sample.py calls that differ only in covariates.age draw the same noise (each
    batch's is seeded by seed and the batch's index), so their volumes differ by what the age does (little, for a
    model trained 2 steps) and far less than a call with another seed."""
    age = torch.load(covariate_ckpt, map_location="cpu", weights_only=True)["hyper_parameters"]["covariates"]
    age = next(c for c in age["columns"] if c["name"] == "age")

    def drawn(value: float, seed: int) -> np.ndarray:
        out = tmp_path / f"age{value}_seed{seed}"
        sample(compose("sample", [f"ckpt_path={covariate_ckpt}", "n=2", "num_inference_steps=2",
                                  f"covariates.age={value}", f"seed={seed}", f"paths.output_dir={out}"]))
        return np.stack([np.asarray(nib.load(p).dataobj) for p in sorted((out / "samples").glob("*_generated.nii.gz"))])

    young, old, other_noise = drawn(age["min"], 0), drawn(age["max"], 0), drawn(age["min"], 1)
    assert young.shape[0] == 2 and np.abs(young - old).max() > 0  # the age reaches the model
    assert np.abs(young - old).mean() < 0.1 * np.abs(young - other_noise).mean()


def test_sample_with_a_list_of_ages_draws_each_mask_at_each_with_the_calls_own_noise(covariate_ckpt, tmp_path) -> None:
    """``covariates.age=[lo,hi]`` in one call writes each mask at each age (``sample_age<value>_<subject>``, the age in
    its sidecar), bit for bit the volumes of two calls with one age each and the same seed."""
    age = torch.load(covariate_ckpt, map_location="cpu", weights_only=True)["hyper_parameters"]["covariates"]
    age = next(c for c in age["columns"] if c["name"] == "age")
    lo, hi = float(age["min"]), float(age["max"])
    base = [f"ckpt_path={covariate_ckpt}", "n=2", "num_inference_steps=2", "seed=3"]

    def volumes(folder: Path) -> dict[str, np.ndarray]:
        return {p.name: np.asarray(nib.load(p).dataobj) for p in sorted(folder.glob("*_generated.nii.gz"))}

    both = tmp_path / "both"
    pngs = sample(compose("sample", [*base, f"covariates.age=[{lo},{hi}]", f"paths.output_dir={both}"]))
    assert len(pngs) == 4
    swept = volumes(both / "samples")
    ages = {name: side["covariates"]["age"] for name, side in _sidecars(both / "samples").items()}
    assert sorted(ages.values()) == [lo, lo, hi, hi]
    for value in (lo, hi):
        one = tmp_path / f"age{value:g}"
        sample(compose("sample", [*base, f"covariates.age={value}", f"paths.output_dir={one}"]))
        for name, volume in volumes(one / "samples").items():
            twin = name.replace("sample_", f"sample_age{value:g}_", 1)
            assert np.array_equal(swept[twin], volume), twin
            assert ages[twin.replace("_generated.nii.gz", "_covariates.json")] == value
    for name in (n for n in swept if n.startswith(f"sample_age{lo:g}_")):  # the age reaches the model
        assert not np.array_equal(swept[name], swept[name.replace(f"age{lo:g}", f"age{hi:g}", 1)])


@pytest.mark.parametrize(("request_", "says"), [
    (["covariates.age=[60]"], r"covariates.age=\[60\]: a list samples every mask at each of its values and needs two"),
    (["covariates.age=[50,60]", "covariates.lesion_load=[0.1,0.2]"],
     r"covariates.lesion_load=\[0.1, 0.2\]: is a list beside covariates.age: one covariate is swept at a time"),
    (["covariates.age=[50,999]"], r"covariates.age=999: is outside the range this model was trained on"),
    (["covariates.age=[50,50.0000001]"], r"covariates.age=\[50, 5.*\]: repeats a value \(as the file names write "
                                         r"them: age50, age50\)"),
])
def test_sample_refuses_a_list_it_cannot_take(covariate_ckpt, tmp_path, request_, says) -> None:
    with pytest.raises(ConfigError, match=says):
        sample(compose("sample", [f"ckpt_path={covariate_ckpt}", "n=1", "num_inference_steps=2", *request_,
                                  f"paths.output_dir={tmp_path}"]))
    assert not list(tmp_path.rglob("*.nii.gz"))


def test_evaluate_refuses_a_list_of_covariate_values_naming_covariate_sweep(covariate_ckpt, tmp_path) -> None:
    from voxdiff.cli.evaluate import validate

    with pytest.raises(ConfigError, match=r"covariates.age=\[50, 60\]: takes one value in this command.*"
                                          r"covariate_sweep=age"):
        validate(compose("evaluate", [f"ckpt_path={covariate_ckpt}", "covariates.age=[50,60]",
                                      f"out_dir={tmp_path}"]))


def test_resume_continues_the_same_covariates_and_refuses_another_list(nifti_run, tiny_demo) -> None:
    root, ckpt = nifti_run
    same = compose("train", [*tiny_demo, f"data.root={root}", "data.covariates=[age,sex]",
                             "paths.output_dir=/nonexistent"])
    assert check_resume(same, str(ckpt)).step == 2
    other = compose("train", [*tiny_demo, f"data.root={root}", "data.covariates=[sex,age]",
                              "paths.output_dir=/nonexistent"])
    with pytest.raises(ConfigError, match=r"data.covariates is \[age, sex\] in the checkpoint and \[sex, age\] now"):
        check_resume(other, str(ckpt))


def test_a_resume_continues_the_encoding_it_learned_or_is_refused(nifti_run, tiny_demo, tmp_path, capsys) -> None:
    """Another table (every age 10 years older) gives the training split another encoding: the resume is refused
    naming the column and how it changed, before training. The same table continues from step 2."""
    root, ckpt = nifti_run
    older = write_table(tmp_path / "older.tsv", {n: {"participant_id": n, "age": str(a + 10), "sex": s, "site": "A"}
                                                 for n, a, s in zip(NAMES, AGES, SEXES, strict=True)})
    base = [*tiny_demo, f"data.root={root}", "data.covariates=[age,sex]", f"ckpt_path={ckpt}", "trainer.max_steps=3"]
    with pytest.raises(SystemExit) as stop:
        train(compose("train", [*base, f"data.covariates_table={older}", f"paths.output_dir={tmp_path / 'older'}"]))
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "data.covariates" in err and "age: mean" in err, err
    assert "the subjects or the participants table changed" in err and "Fix: resume with the subjects" in err
    assert not list((tmp_path / "older").rglob("*.ckpt"))  # refused before anything trained
    report = train(compose("train", [*base, f"paths.output_dir={tmp_path / 'same'}"]))
    assert torch.load(report["last_checkpoint"], map_location="cpu", weights_only=True)["global_step"] == 3


def test_evaluate_reports_whether_age_is_obeyed_beside_a_negative_control(covariate_ckpt, diffusion_ckpt,
                                                                           tmp_path) -> None:
    out = tmp_path / "eval"
    record = evaluate(compose("evaluate", [f"ckpt_path={covariate_ckpt}", "n=4", "covariate_sweep=age",
                                           f"control_ckpt={diffusion_ckpt}", "num_inference_steps=2",
                                           "random_features_seed=null", f"paths.output_dir={out}"]))
    figures = record["figures"]
    generated, control = figures["covariate_age_ventricles_generated"], figures["covariate_age_ventricles_control"]
    assert generated["n"] == control["n"] == 4 and figures["covariate_age_ventricles_real"]["n"] == 2
    assert all(-1 <= f["value"] <= 1 or np.isnan(f["value"]) for f in (generated, control))
    ages = [row["age"] for row in record["sampling"]["covariates"]]
    assert len(set(ages)) == 4 and np.allclose(np.diff(sorted(ages)), np.diff(sorted(ages))[0])  # evenly spaced
    assert ages != sorted(ages)  # in a shuffled order: the second mask does not always get the higher age
    assert "Covariates: is age obeyed?" in Path(record["html"]).read_text()
    assert len(_sidecars(out / "samples")) == 4  # the model's samples, each with its ages
    assert len(list((out / "samples").glob("control_*_generated.nii.gz"))) == 4  # the control's (no covariates)
    control = _volumes(out / "samples", "control")
    assert np.abs(control[0] - control[2]).max() > 0  # one mask, another noise: without counterfactual=true
    saved = json.loads(Path(record["json"]).read_text())
    assert saved["figures"]["covariate_age_ventricles_control"]["checkpoint"] == str(diffusion_ckpt)
    # the model's other covariate, sex, is measured on the same samples (the head's size), beside the same control
    assert figures["covariate_sex_head_generated"]["n"] == figures["covariate_sex_head_control"]["n"] == 4
    assert "Covariates: is sex obeyed?" in Path(record["html"]).read_text()
    # the probe reads a feature extractor's features, and this evaluation has none on (random_features_seed=null)
    assert "none is on" in record["absent"]["covariate_age_probe_generated"]


def _volumes(folder: Path, tag: str) -> dict[int, np.ndarray]:
    """The generated volumes ``<tag>_<subject>_s<i>_generated.nii.gz`` of an evaluation, by sample index i."""
    return {int(p.name.split("_s")[-1][:3]): np.asarray(nib.load(p).dataobj)
            for p in folder.glob(f"{tag}_*_generated.nii.gz")}


def test_counterfactuals_draw_each_mask_at_every_age_with_the_same_noise(covariate_ckpt, diffusion_ckpt,
                                                                          tmp_path) -> None:
    """counterfactual=true: the two validation masks at three ages, each mask with one noise at every age, and the
    effect of age within each mask; beside the control (no covariates), whose samples of a mask are then the same
    volume at every age: its effect is exactly 0."""
    out = tmp_path / "eval"
    record = evaluate(compose("evaluate", [f"ckpt_path={covariate_ckpt}", "n=6", "covariate_sweep=age",
                                           "counterfactual=true", f"control_ckpt={diffusion_ckpt}",
                                           "num_inference_steps=2", "random_features_seed=null",
                                           f"paths.output_dir={out}"]))
    ages = [row["age"] for row in record["sampling"]["covariates"]]
    assert ages[0] == ages[1] < ages[2] == ages[3] < ages[4] == ages[5]  # one age per cycle over the two masks
    assert ages[2] - ages[0] == pytest.approx(ages[4] - ages[2])  # evenly over the training range
    assert record["sampling"]["counterfactual"] is True
    subjects = record["sampling"]["conditioned_on"]
    assert subjects == subjects[:2] * 3 and subjects[0] != subjects[1]
    control, model = _volumes(out / "samples", "control"), _volumes(out / "samples", "eval")
    assert sorted(control) == sorted(model) == list(range(6))
    for i in range(2):  # the same mask and noise: the control draws one volume, the model one per age
        np.testing.assert_array_equal(control[i], control[i + 2])
        np.testing.assert_array_equal(control[i], control[i + 4])
        assert np.abs(model[i] - model[i + 2]).max() > 0
    figures = record["figures"]
    generated = figures["covariate_age_ventricles_effect_generated"]
    assert generated["n"] == 2 and len(generated["per_group"]) == 2 and "se" in generated and "t" in generated
    assert figures["covariate_age_ventricles_effect_control"]["value"] == 0.0
    assert figures["covariate_age_ventricles_effect_control"]["checkpoint"] == str(diffusion_ckpt)
    assert figures["covariate_age_ventricles_effect_real"]["n"] == 2  # the real subjects' own ages
    # a control without covariates has no training pairs to read its effect against: said, not faked
    assert "without covariates" in record["absent"]["covariate_age_ventricles_effect_control_data"]
    assert "covariate_sex_head_effect_generated" not in figures  # sex is each subject's own, not swept
    assert figures["covariate_age_ventricles_generated"]["n"] == 6  # the correlation over every sample, as before


def test_a_shuffled_controls_effect_comes_with_the_chance_slope_its_training_pairs_hold(covariate_ckpt, tiny_covariates,
                                                                                       tmp_path):
    """A control trained with data.shuffle_covariates=true: beside its counterfactual effect, the slope of its real
    training images' ventricle size on the ages it trained them with (another subject's each), computed here
    independently from the ages its training items' vectors encode."""
    from voxdiff.data.datamodule import VolumeDataModule
    from voxdiff.data.phantom import head_voxels, ventricle_voxels
    from voxdiff.evaluation.metrics import slope

    report = train(compose("train", [*tiny_covariates, "data.shuffle_covariates=true",
                                     f"paths.output_dir={tmp_path / 'control'}"]))
    record = evaluate(compose("evaluate", [f"ckpt_path={covariate_ckpt}", "n=6", "covariate_sweep=age",
                                           "counterfactual=true", f"control_ckpt={report['last_checkpoint']}",
                                           "num_inference_steps=2", "random_features_seed=null",
                                           f"paths.output_dir={tmp_path / 'eval'}"]))
    data = record["figures"]["covariate_age_ventricles_effect_control_data"]

    cfg = compose("train", [*tiny_covariates, "data.shuffle_covariates=true"])
    dm = VolumeDataModule(volume_shape=list(cfg.data.volume_shape), num_subjects=int(cfg.data.num_subjects),
                          batch_size=1, covariates=["age", "sex"], shuffle_covariates=True)
    dm.setup("fit")
    age = dm.covariate_encoding.columns[0]
    assert age.name == "age"
    items = [dm.train_dataset[i] for i in range(len(dm.train_dataset))]
    ages = [float(item["covariates"][0]) * age.std + age.mean for item in items]  # what the vector encodes
    expected = slope(ages, [ventricle_voxels(item["image"]) for item in items])
    assert data["n"] == len(items) == 4
    assert data["value"] == pytest.approx(expected["value"], rel=1e-4)
    assert data["se"] == pytest.approx(expected["se"], rel=1e-4)
    own = [float(dm.covariate_values[str(item["subject"])]["age"]) for item in items]
    assert all(abs(o - a) > 1e-3 for o, a in zip(own, ages, strict=True))  # each trained with another's age
    assert data["checkpoint"] == str(report["last_checkpoint"])
    assert "covariate_age_ventricles_effect_control_data" not in record["absent"]

    # a sweep over sex: the head's difference M - F that the same control's training pairs hold, each subject's
    # level read from its vector (the level whose encoding it matches)
    record = evaluate(compose("evaluate", [f"ckpt_path={covariate_ckpt}", "n=4", "covariate_sweep=sex",
                                           "counterfactual=true", f"control_ckpt={report['last_checkpoint']}",
                                           "num_inference_steps=2", "random_features_seed=null",
                                           f"paths.output_dir={tmp_path / 'eval_sex'}"]))
    sex = record["figures"]["covariate_sex_head_effect_control_data"]
    levels = ["F", "M"]
    codes = [dm.covariate_encoding.vector({"age": "50", "sex": level}) for level in levels]
    trained = [min(range(2), key=lambda k: float((item["covariates"][1:] - codes[k][1:]).abs().sum()))
               for item in items]
    expected = slope([float(k) for k in trained], [head_voxels(item["image"]) for item in items])
    assert sex["n"] == 4 and sex["value"] == pytest.approx(expected["value"], rel=1e-4)


def test_a_sweep_over_sex_alternates_its_levels_and_codes_them_for_the_figure(covariate_ckpt, tmp_path) -> None:
    record = evaluate(compose("evaluate", [f"ckpt_path={covariate_ckpt}", "n=4", "covariate_sweep=sex",
                                           "num_inference_steps=2", "random_features_seed=null",
                                           f"paths.output_dir={tmp_path / 'eval'}"]))
    # two validation masks, used in turn: each is drawn at each level (not F on one mask and M on the other)
    assert [row["sex"] for row in record["sampling"]["covariates"]] == ["F", "F", "M", "M"]
    figures = record["figures"]
    assert figures["covariate_sex_head_generated"]["n"] == 4 and figures["covariate_sex_head_real"]["n"] == 2
    assert "covariate_sex_head_control" in record["absent"]  # no control_ckpt: said, not faked


def test_the_table_is_skipped_only_where_it_is_not_the_anatomy() -> None:
    """Every covariate requested: a NIfTI run's data module does not read its table; the phantom's keeps its
    covariates, which shape its anatomy and masks (the real volumes an evaluation compares with)."""
    from voxdiff.cli.covariate_args import without_table
    from voxdiff.data.covariates import Column, CovariateEncoding

    encoding = CovariateEncoding((Column("age", "numeric", 50.0, 10.0, 30.0, 70.0),))
    nifti = {"data": {"_target_": "voxdiff.data.VolumeDataModule", "root": "/data", "covariates": ["age"]}}
    phantom = {"data": {"_target_": "voxdiff.data.VolumeDataModule", "root": None, "covariates": ["age"]}}
    assert without_table(nifti, encoding, {"age": 40.0})["data"]["covariates"] == []
    assert without_table(nifti, encoding, {})["data"]["covariates"] == ["age"]
    assert without_table(phantom, encoding, {"age": 40.0})["data"]["covariates"] == ["age"]


def test_an_evaluation_fits_the_probe_on_its_real_volumes_random_network_features(covariate_ckpt, tmp_path) -> None:
    """Wired end to end: eight real phantom subjects (split=all), the random ResNet-10's features (on by default):
    the probe's leave-one-out figure on them, and its reading of the generated volumes or why not."""
    record = evaluate(compose("evaluate", [f"ckpt_path={covariate_ckpt}", "n=8", "split=all", "data.num_subjects=8",
                                           "num_inference_steps=2", f"paths.output_dir={tmp_path / 'eval'}"]))
    for name in ("age", "sex"):
        real = record["figures"][f"covariate_{name}_probe_real"]
        assert real["n"] == 8 and real["features"].startswith("random 3D ResNet-10") and -1 <= real["value"] <= 1
        generated = record["figures"].get(f"covariate_{name}_probe_generated")
        if real["value"] >= 0.5:
            assert generated is not None and generated["n"] == 8
        else:
            assert generated is None and "reads too little" in record["absent"][f"covariate_{name}_probe_generated"]


def _dark_share_volumes(shares: list[float], seed: int) -> torch.Tensor:
    """16³ volumes whose share of dark voxels (0.1) among bright ones (0.8) is each value of ``shares``, placed at
    random: a covariate that shows in the intensities only (as atrophy does: more CSF)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for share in shares:
        v = torch.full((16 ** 3,), 0.8)
        v[torch.randperm(16 ** 3, generator=g)[: int(share * 16 ** 3)]] = 0.1
        out.append(v.reshape(1, 16, 16, 16))
    return torch.stack(out)


def test_a_probe_reads_a_covariate_that_shows_in_the_intensities_and_not_a_control_that_ignores_it() -> None:
    """The probe's figures on volumes made to order: 12 real ones whose dark share is age/200, generated ones drawn
    at requested ages the same way (obeyed), a control's at shares unrelated to the age (not obeyed)."""
    from voxdiff.cli.evaluate import PROBE_MIN_SUBJECTS, _probe_figures
    from voxdiff.evaluation.pipeline import Drawn, VolumeSet
    from voxdiff.evaluation.uncertainty import Bootstrap

    rng = np.random.default_rng(0)
    real_ages = [float(a) for a in rng.uniform(20, 90, 12)]
    images = _dark_share_volumes([a / 200 for a in real_ages], seed=1)
    real = VolumeSet(images, torch.zeros_like(images), torch.eye(4).expand(12, 4, 4), [f"s{i}" for i in range(12)])
    requested = [20.0 + 5 * i for i in range(15)]
    obeyed = _dark_share_volumes([a / 200 for a in requested], seed=2)
    ignored = _dark_share_volumes(list(rng.uniform(0.1, 0.45, 15)), seed=3)
    from voxdiff.evaluation.metrics import histograms

    def probe(real_set, control):  # the intensity histogram: the features a dark share shows in
        volumes = {"real": real_set.images, "generated": obeyed, "control": control}
        return _probe_figures("age", "age", requested, real_ages[:len(real_set)],
                              lambda tag: histograms(volumes[tag], 64), "64-bin histograms",
                              None if control is None else "control.ckpt",
                              Drawn({"generated": 15, "real": len(real_set)}, Bootstrap(resamples=500)))

    figures, absent, sections = probe(real, ignored)
    assert figures["covariate_age_probe_real"]["value"] > 0.95 and figures["covariate_age_probe_real"]["n"] == 12
    assert figures["covariate_age_probe_generated"]["value"] > 0.95
    assert abs(figures["covariate_age_probe_control"]["value"]) < 0.5
    # each r with its interval over the 15 volumes (the probe held): the obeyed one's far from the control's
    obeyed_ci, control_ci = (figures[f"covariate_age_probe_{k}"]["ci"] for k in ("generated", "control"))
    assert obeyed_ci[0] > 0.9 and control_ci[1] < obeyed_ci[0] and control_ci[0] < 0 < control_ci[1]
    assert "ci" not in figures["covariate_age_probe_real"]  # a leave-one-out r: not resampled
    assert figures["covariate_age_probe_generated"]["label"].startswith("age obeyed, by a probe")
    assert figures["covariate_age_probe_real"]["features"] == "64-bin histograms"
    assert not absent and sections[0][0] == "Covariates: is age obeyed? (probe)"
    # real volumes whose intensities do not carry the age: the probe reads nothing, and says so
    unrelated = VolumeSet(_dark_share_volumes(list(rng.uniform(0.1, 0.45, 12)), seed=4), real.masks, real.affines,
                          real.subjects)
    figures, absent, sections = probe(unrelated, ignored)
    assert figures["covariate_age_probe_real"]["value"] < 0.5 and list(figures) == ["covariate_age_probe_real"]
    assert "reads too little of age" in absent["covariate_age_probe_generated"] and not sections
    # too few real volumes to fit it on: said, not faked
    few = VolumeSet(images[:PROBE_MIN_SUBJECTS - 1], images[:PROBE_MIN_SUBJECTS - 1], real.affines[:7], [])
    figures, absent, sections = probe(few, None)
    assert not figures and not sections and "needs 8" in absent["covariate_age_probe_generated"]
