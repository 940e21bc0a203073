"""Covariates from the participants table: reading, the encoding fitted on the training split, every refusal
naming the file, the subject and the column; and the phantom's covariates, which shape its anatomy."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from voxdiff.data.covariates import (
    CovariateEncoding,
    estimated_width,
    fit_encoding,
    parse_covariates,
    read_table,
    write_table,
)
from voxdiff.data.nifti import DataError
from voxdiff.data.phantom import (
    LABELS, PHANTOM_COVARIATES, head_voxels, make_phantom, phantom_covariates, ventricle_voxels,
)
from voxdiff.errors import ConfigError

TABLE = {
    "sub-01": {"participant_id": "sub-01", "age": "30", "sex": "F", "site": "1"},
    "sub-02": {"participant_id": "sub-02", "age": "50", "sex": "M", "site": "2"},
    "sub-03": {"participant_id": "sub-03", "age": "70", "sex": "F", "site": "1"},
    "sub-04": {"participant_id": "sub-04", "age": "90", "sex": "M", "site": "2"},
}
TRAIN, VAL = ["sub-01", "sub-02", "sub-03"], ["sub-04"]


def test_a_bids_table_is_read_and_encoded_with_the_training_splits_statistics(tmp_path) -> None:
    path = write_table(tmp_path / "participants.tsv", TABLE)
    assert path.read_text().splitlines()[0] == "participant_id\tage\tsex\tsite"
    table = read_table(path)
    assert table == TABLE
    enc = fit_encoding(table, str(path), parse_covariates(["age", "sex", "site:categorical"]), TRAIN, VAL)
    age, sex, site = enc.columns
    assert (age.kind, sex.kind, site.kind) == ("numeric", "categorical", "categorical")
    assert age.mean == pytest.approx(50.0) and age.std == pytest.approx(np.std([30, 50, 70]))  # not sub-04's 90
    assert (age.lo, age.hi) == (30.0, 70.0) and sex.levels == ("F", "M") and site.levels == ("1", "2")
    assert enc.width == 1 + 2 + 2 + 1
    v = enc.vector(table["sub-04"])
    assert torch.allclose(v, torch.tensor([(90 - 50) / age.std, 0, 1, 0, 1, 1.0]))
    assert torch.equal(enc.null(), torch.zeros(6))  # presence 0: no subject's vector
    assert CovariateEncoding.from_plain(enc.to_plain()) == enc  # what the checkpoint stores gives it back
    # values() inverts vector(): each subject's row back (what a sample's sidecar records); the null: none
    for subject, row in TABLE.items():
        assert enc.values(enc.vector(row)) == {"age": float(row["age"]), "sex": row["sex"], "site": row["site"]}
    assert enc.values(enc.null()) == {}
    with pytest.raises(ValueError, match="has 6 entries, got 5"):
        enc.values(torch.zeros(5))


def test_requested_values_outside_training_are_refused(tmp_path) -> None:
    enc = fit_encoding(TABLE, "t", parse_covariates(["age", "sex"]), TRAIN, VAL)
    assert enc.check_value("covariates.age", "age", "45") == 45.0
    with pytest.raises(ConfigError, match=r"covariates.age=71: is outside the range .* \[30, 70\]"):
        enc.check_value("covariates.age", "age", 71)
    with pytest.raises(ConfigError, match=r"covariates.sex=X: is not a level .* Fix: use one of F, M"):
        enc.check_value("covariates.sex", "sex", "X")
    with pytest.raises(ConfigError, match=r"covariates.height=.*not 'height'"):
        enc.check_value("covariates.height", "height", 1)


@pytest.mark.parametrize("value, words", [
    ("age", ["a list of column names"]),
    (["age", "age"], ["listed twice"]),
    (["age:ordinal"], ["neither numeric nor categorical"]),
    (["participant_id"], ["names the subjects"]),
    ([3], ["is not a column name"]),
])
def test_a_bad_covariate_list_is_refused(value, words) -> None:
    with pytest.raises(ConfigError) as err:
        parse_covariates(value)
    assert str(err.value).startswith("data.covariates=") and all(w in str(err.value) for w in words)


def _refusal(table, names, train=TRAIN, val=VAL) -> str:
    with pytest.raises(DataError) as err:
        fit_encoding(table, "/data/participants.tsv", parse_covariates(names), train, val)
    return str(err.value)


def test_every_problem_of_the_table_names_the_file_the_subject_and_the_column(tmp_path) -> None:
    assert "no column 'height'" in _refusal(TABLE, ["height"])
    missing = {k: v for k, v in TABLE.items() if k != "sub-02"}
    assert "subject sub-02 has no row" in _refusal(missing, ["age"])
    text = {**TABLE, "sub-03": {**TABLE["sub-03"], "age": "seventy"}}
    msg = _refusal(text, ["age"])
    assert "sub-03" in msg and "'seventy'" in msg and "numeric column 'age'" in msg and "age:categorical" in msg
    empty = {**TABLE, "sub-01": {**TABLE["sub-01"], "age": "n/a"}}
    assert "subject sub-01 has no value in column 'age'" in _refusal(empty, ["age"])
    unseen = {**TABLE, "sub-04": {**TABLE["sub-04"], "sex": "X"}}
    msg = _refusal(unseen, ["sex"])
    assert "sub-04 (validation)" in msg and "'X'" in msg and "column 'sex'" in msg
    constant = {k: {**v, "age": "40"} for k, v in TABLE.items()}
    assert "has the value 40 for every training subject" in _refusal(constant, ["age"])
    for msg in [_refusal(TABLE, ["height"]), _refusal(missing, ["age"])]:
        assert msg.startswith("/data/participants.tsv") and "Fix:" in msg
    with pytest.raises(DataError, match=r"nothing.tsv: no participants table .*data.covariates_table"):
        read_table(tmp_path / "nothing.tsv")
    (tmp_path / "bad.tsv").write_text("id,age\nsub-01,3\n")
    with pytest.raises(DataError, match="no participant_id column"):
        read_table(tmp_path / "bad.tsv")


def test_the_phantom_is_unchanged_without_covariates_and_ages_with_them() -> None:
    shape = (32, 48, 48)  # the demo's size
    # the phantom as it always was, bit for bit (the covariates are drawn from a stream of their own)
    assert all(np.array_equal(a, b) for a, b in zip(make_phantom(shape, 3), make_phantom(shape, 3, covariates=False),
                                                     strict=True))
    assert phantom_covariates(3) == phantom_covariates(3) and set(phantom_covariates(3)) == set(PHANTOM_COVARIATES)
    ages, true_volume, measured, load, lesions = [], [], [], [], []
    for seed in range(12):
        c = phantom_covariates(seed)
        image, mask, labels = make_phantom(shape, seed, return_labels=True, covariates=True)
        ages.append(c["age"])
        true_volume.append(int((labels == LABELS["ventricle"]).sum()))
        measured.append(ventricle_voxels(image))
        load.append(c["lesion_load"])
    assert np.corrcoef(ages, true_volume)[0, 1] > 0.8  # older: larger ventricles
    assert np.corrcoef(ages, measured)[0, 1] > 0.7  # and the evaluation's measure sees it
    assert len(set(ages)) > 6 and set(load) <= {1, 2, 3, 4}
    plain_measured = [ventricle_voxels(make_phantom(shape, s)[0]) for s in range(12)]
    assert abs(np.corrcoef(ages, plain_measured)[0, 1]) < 0.5  # without covariates the age is not in the anatomy


def test_the_head_measure_sees_the_phantoms_sex() -> None:
    """sex=M scales the phantom's head by 5%: the evaluation's head count is larger for M on average, and carries
    nothing of sex without covariates (its subjects then share one scale law)."""
    shape = (32, 48, 48)
    sex = np.array([phantom_covariates(s)["sex"] == "M" for s in range(24)], dtype=float)
    heads = np.array([head_voxels(make_phantom(shape, s, covariates=True)[0]) for s in range(24)], dtype=float)
    plain = np.array([head_voxels(make_phantom(shape, s)[0]) for s in range(24)], dtype=float)
    assert 0 < sex.mean() < 1
    assert heads[sex == 1].mean() > 1.04 * heads[sex == 0].mean()  # 5% in each axis: ~10% in the count
    assert np.corrcoef(sex, heads)[0, 1] > np.corrcoef(sex, plain)[0, 1] + 0.2
    assert head_voxels(np.zeros((1, 4, 4, 4))) == 0 and head_voxels(np.ones((4, 4, 4))) == 64


def test_the_preflights_width_is_exact_for_the_phantom() -> None:
    assert estimated_width([], phantom=True) == 0 and estimated_width(None, phantom=False) == 0
    assert estimated_width(["age", "sex"], phantom=True) == 1 + 2 + 1
    assert estimated_width(["age", "sex"], phantom=False) == 3  # a table's levels are not known without it


@pytest.mark.parametrize("shuffle", [False, True])
def test_each_training_item_carries_the_vector_of_the_values_it_trains_with(shuffle) -> None:
    """``covariate_trained_values`` are the values each subject's vector encodes: its own, or under
    ``shuffle_covariates`` (a negative control) another subject's, never its own; ``covariate_values`` stay the
    subject's own (what sampling starts from)."""
    from voxdiff.data.datamodule import VolumeDataModule

    dm = VolumeDataModule(volume_shape=[16, 16, 16], num_subjects=8, batch_size=2, covariates=["age", "sex"],
                          shuffle_covariates=shuffle)
    dm.setup("fit")
    encoding = dm.covariate_encoding
    for dataset, subjects in ((dm.train_dataset, dm.train_subjects), (dm.val_dataset, dm.val_subjects)):
        for i, subject in enumerate(subjects):
            item = dataset[i]
            assert item["subject"] == subject
            torch.testing.assert_close(item["covariates"],
                                       encoding.vector(dm.covariate_trained_values[subject]))
            own = dm.covariate_values[subject]
            assert (own == dm.covariate_trained_values[subject]) is (not shuffle)
