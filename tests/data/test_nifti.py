"""NIfTI folders: discovery, the MONAI pipeline (RAS, [0, 1], binary mask, pad/crop), caching, and bad input."""

import gzip
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import torch
from voxdiff.data.nifti import DataError, NiftiDataset, check_subject, find_subjects

SHAPE = (10, 12, 14)
LPS = np.array([[-2.0, 0, 0, 30.0], [0, -1.0, 0, 40.0], [0, 0, 1.5, -10.0], [0, 0, 0, 1]])


def _image(shape=SHAPE, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).uniform(100, 500, size=shape).astype(np.float32)


def write_subject(
    root: Path,
    name: str,
    image: np.ndarray | None = None,
    mask: np.ndarray | None = None,
    affine: np.ndarray = LPS,
    mask_affine: np.ndarray | None = None,
    image_name: str = "bravo.nii.gz",
    mask_name: str = "seg.nii.gz",
) -> Path:
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    image = _image() if image is None else image
    mask = np.zeros(image.shape, np.float32) if mask is None else mask
    nib.save(nib.Nifti1Image(image, affine), str(folder / image_name))
    nib.save(nib.Nifti1Image(mask, affine if mask_affine is None else mask_affine), str(folder / mask_name))
    return folder


def test_find_subjects_sorted_and_hidden_folders_skipped(tmp_path):
    for name in ("c", "a", "b"):
        write_subject(tmp_path, name)
    (tmp_path / ".cache").mkdir()
    (tmp_path / "notes.txt").write_text("not a subject")
    subjects = find_subjects(tmp_path)
    assert [s["subject"] for s in subjects] == ["a", "b", "c"]
    assert subjects[0]["image"] == str(tmp_path / "a" / "bravo.nii.gz")
    assert subjects[0]["mask"] == str(tmp_path / "a" / "seg.nii.gz")


def test_custom_file_names(tmp_path):
    write_subject(tmp_path, "s1", image_name="t1.nii", mask_name="lesion.nii")
    subjects = find_subjects(tmp_path, image_name="t1.nii", mask_name="lesion.nii")
    assert subjects[0]["image"].endswith("t1.nii")
    sample = NiftiDataset(subjects, (8, 8, 8))[0]
    assert sample["image"].shape == (1, 8, 8, 8)


def test_sample_contract_range_binarisation_and_pad_crop(tmp_path):
    mask = np.zeros(SHAPE, np.float32)
    mask[4, 5, 6] = 0.4  # dropped
    mask[5, 6, 7] = 0.6  # kept
    mask[6, 6, 7] = 3.0  # other labels count as lesion
    write_subject(tmp_path, "s1", mask=mask)
    volume_shape = (8, 16, 14)  # crop D, pad H, keep W
    sample = NiftiDataset.from_root(tmp_path, volume_shape)[0]
    assert set(sample) == {"image", "mask", "subject", "affine"}
    assert type(sample["image"]) is torch.Tensor and type(sample["mask"]) is torch.Tensor
    assert sample["image"].shape == (1, *volume_shape) and sample["image"].dtype == torch.float32
    assert sample["mask"].shape == (1, *volume_shape) and sample["mask"].dtype == torch.float32
    assert sample["affine"].shape == (4, 4) and sample["affine"].dtype == torch.float64
    assert sample["subject"] == "s1"
    image = sample["image"]
    assert image.min() >= 0.0 and image.max() <= 1.0
    assert torch.unique(sample["mask"]).tolist() == [0.0, 1.0]
    assert sample["mask"].sum() == 2
    # the 2 padded rows of H on each side are zero
    assert image[:, :, :2].abs().max() == 0 and image[:, :, -2:].abs().max() == 0


def test_percentile_scaling_clips_outliers(tmp_path):
    image = _image()
    image[0, 0, 0] = 1e6  # one hot voxel must not squash the rest
    write_subject(tmp_path, "s1", image=image)
    out = NiftiDataset.from_root(tmp_path, SHAPE)[0]["image"]
    assert out.max() == 1.0 and out.min() == 0.0
    assert 0.3 < out.median() < 0.7  # the bulk of the uniform intensities spans the window
    assert (out == 1.0).sum() < 0.02 * out.numel()


def test_lps_input_is_reoriented_to_ras_and_the_affine_follows(tmp_path):
    image = _image()
    mask = np.zeros(SHAPE, np.float32)
    marker = (7, 3, 9)
    mask[marker] = 1.0
    image[:, :, 0] = 0.0  # a dark inferior-most slice, to follow the image's orientation too
    write_subject(tmp_path, "s1", image=image, mask=mask)
    volume_shape = (12, 12, 12)  # pad D, keep H, crop W
    sample = NiftiDataset.from_root(tmp_path, volume_shape)[0]
    affine = sample["affine"].numpy()
    # RAS: a positive diagonal, same voxel sizes
    assert np.allclose(np.diag(affine)[:3], [2.0, 1.0, 1.5])
    assert np.allclose(affine[:3, :3], np.diag([2.0, 1.0, 1.5]))
    # the marker sits at the same world position before and after
    found = tuple(int(i) for i in torch.nonzero(sample["mask"][0])[0])
    assert sample["mask"].sum() == 1
    world_in = LPS @ np.array([*marker, 1.0])
    world_out = affine @ np.array([*found, 1.0])
    assert np.allclose(world_in, world_out)
    # left-right and anterior-posterior flipped (LPS → RAS), D padded by 1 on each side, W cropped by 1
    assert found == (1 + (SHAPE[0] - 1 - marker[0]), SHAPE[1] - 1 - marker[1], marker[2] - 1)
    # the image went through the same reorientation: its dark slice z = 0 was cropped away, z = 1 kept
    image_out = sample["image"][0]
    assert image_out[1:-1, :, 0].min() > 0 and image_out[0].abs().max() == 0 and image_out[-1].abs().max() == 0


def test_cache_modes_agree_and_disk_cache_is_written_and_reused(tmp_path):
    root = tmp_path / "data"
    for i in range(2):
        write_subject(root, f"s{i}", image=_image(seed=i))
    subjects = find_subjects(root)
    cache_dir = tmp_path / "cache"
    plain = NiftiDataset(subjects, (8, 8, 8), cache="none")
    memory = NiftiDataset(subjects, (8, 8, 8), cache="memory")
    disk = NiftiDataset(subjects, (8, 8, 8), cache="disk", cache_dir=cache_dir)
    for i in range(2):
        a, b, c = plain[i], memory[i], disk[i]
        for key in ("image", "mask", "affine"):
            assert torch.equal(a[key], b[key]) and torch.equal(a[key], c[key])
        assert a["subject"] == b["subject"] == c["subject"] == f"s{i}"
    files = sorted(cache_dir.rglob("*.pt"))
    assert len(files) == 2
    # a second dataset (a new run) reads the cache: the entries are not rewritten
    mtimes = [f.stat().st_mtime_ns for f in files]
    again = NiftiDataset(subjects, (8, 8, 8), cache="disk", cache_dir=cache_dir)
    assert torch.equal(again[1]["image"], plain[1]["image"])
    assert [f.stat().st_mtime_ns for f in files] == mtimes
    # another volume_shape gets its own cache folder
    NiftiDataset(subjects, (6, 8, 8), cache="disk", cache_dir=cache_dir)[0]
    assert len(list(cache_dir.iterdir())) == 2


# ---------------------------------------------------------------------------------------------- bad input


def test_missing_root(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(DataError, match="does not exist") as info:
        find_subjects(missing)
    assert str(missing) in str(info.value)


def test_missing_image_names_the_file_and_the_key(tmp_path):
    folder = write_subject(tmp_path, "s1")
    (folder / "bravo.nii.gz").unlink()
    with pytest.raises(DataError) as info:
        find_subjects(tmp_path)
    assert str(folder / "bravo.nii.gz") in str(info.value)
    assert "data.image_name" in str(info.value)


def test_missing_mask_names_the_file_and_the_key(tmp_path):
    folder = write_subject(tmp_path, "s1")
    (folder / "seg.nii.gz").unlink()
    with pytest.raises(DataError) as info:
        find_subjects(tmp_path)
    assert str(folder / "seg.nii.gz") in str(info.value)
    assert "data.mask_name" in str(info.value)


def _random_bytes(path: Path) -> None:
    path.write_bytes(np.random.default_rng(0).bytes(4000))


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _gzip_random(path: Path) -> None:
    path.write_bytes(gzip.compress(np.random.default_rng(1).bytes(4000)))


@pytest.mark.parametrize("damage", [_random_bytes, _truncate, _gzip_random], ids=["random", "truncated", "gz-random"])
@pytest.mark.parametrize("which", ["bravo.nii.gz", "seg.nii.gz"])
def test_corrupt_file_is_named_at_discovery(tmp_path, damage, which):
    folder = write_subject(tmp_path, "s1")
    damage(folder / which)
    with pytest.raises(DataError) as info:
        find_subjects(tmp_path)
    assert str(folder / which) in str(info.value)


def test_truncated_uncompressed_nifti_is_named(tmp_path):
    folder = write_subject(tmp_path, "s1", image_name="bravo.nii")
    _truncate(folder / "bravo.nii")
    with pytest.raises(DataError, match="truncated") as info:
        find_subjects(tmp_path, image_name="bravo.nii")
    assert str(folder / "bravo.nii") in str(info.value)


@pytest.mark.parametrize("cache", ["none", "memory"])
def test_corrupt_file_found_at_load_time_is_named(tmp_path, cache):
    """Without the up-front check (validate=False) the loader itself names the file."""
    folder = write_subject(tmp_path, "s1")
    subjects = find_subjects(tmp_path)
    _truncate(folder / "bravo.nii.gz")
    with pytest.raises(DataError) as info:
        NiftiDataset(subjects, (8, 8, 8), cache=cache, validate=False)[0]
    assert str(folder / "bravo.nii.gz") in str(info.value)


def test_nan_voxels_are_refused_naming_the_file(tmp_path):
    image = _image()
    image[1, 2, 3] = np.nan
    folder = write_subject(tmp_path, "s1", image=image)
    with pytest.raises(DataError, match="NaN") as info:
        NiftiDataset.from_root(tmp_path, (8, 8, 8))[0]
    assert str(folder / "bravo.nii.gz") in str(info.value)


def test_shape_mismatch_names_both_files_and_shapes(tmp_path):
    folder = tmp_path / "s1"
    folder.mkdir()
    nib.save(nib.Nifti1Image(_image(), LPS), str(folder / "bravo.nii.gz"))
    nib.save(nib.Nifti1Image(np.zeros((10, 12, 13), np.float32), LPS), str(folder / "seg.nii.gz"))
    with pytest.raises(DataError) as info:
        find_subjects(tmp_path)
    message = str(info.value)
    assert str(folder / "bravo.nii.gz") in message and str(folder / "seg.nii.gz") in message
    assert "(10, 12, 14)" in message and "(10, 12, 13)" in message


def test_affine_mismatch_names_both_files(tmp_path):
    shifted = LPS.copy()
    shifted[0, 3] += 1.0  # half a voxel along x (2 mm voxels)
    folder = write_subject(tmp_path, "s1", mask_affine=shifted)
    with pytest.raises(DataError, match="affines differ") as info:
        check_subject(find_subjects(tmp_path, validate=False)[0])
    assert str(folder / "bravo.nii.gz") in str(info.value) and str(folder / "seg.nii.gz") in str(info.value)
    # float rounding far below a voxel is accepted
    close = LPS.copy()
    close[0, 3] += 1e-4
    write_subject(tmp_path, "s1", mask_affine=close)
    find_subjects(tmp_path)


def test_non_3d_volume_is_refused(tmp_path):
    folder = tmp_path / "s1"
    folder.mkdir()
    nib.save(nib.Nifti1Image(np.zeros((4, 4, 4, 2), np.float32), LPS), str(folder / "bravo.nii.gz"))
    nib.save(nib.Nifti1Image(np.zeros((4, 4, 4), np.float32), LPS), str(folder / "seg.nii.gz"))
    with pytest.raises(DataError, match="3D") as info:
        find_subjects(tmp_path)
    assert str(folder / "bravo.nii.gz") in str(info.value)


def test_empty_root_is_refused(tmp_path):
    with pytest.raises(DataError, match="no subject folders") as info:
        find_subjects(tmp_path)
    assert str(tmp_path) in str(info.value)
