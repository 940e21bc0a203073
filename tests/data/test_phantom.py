"""The procedural phantom: deterministic, any shape, brain-like tissue contrast, lesions where the mask says."""

import time

import numpy as np
import pytest
import torch
from voxdiff.data.phantom import LABELS, PhantomDataset, make_phantom
from voxdiff.errors import ConfigError

SMALL = (16, 24, 24)
MEDIUM = (32, 40, 40)


def test_same_seed_is_bit_identical():
    a = make_phantom(SMALL, 3, return_labels=True)
    b = make_phantom(SMALL, 3, return_labels=True)
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype
        assert np.array_equal(x, y)


def test_different_seeds_give_different_subjects():
    img0, mask0 = make_phantom(SMALL, 0)
    img1, mask1 = make_phantom(SMALL, 1)
    assert np.abs(img0 - img1).mean() > 0.01
    assert not np.array_equal(mask0, mask1)


@pytest.mark.parametrize("shape", [(20, 36, 28), (16, 16, 16), (9, 13, 11)])
def test_any_shape_dtype_and_range(shape):
    image, mask = make_phantom(shape, 5)
    assert image.shape == shape and mask.shape == shape
    assert image.dtype == np.float32 and mask.dtype == np.float32
    assert 0.0 <= image.min() and image.max() <= 1.0
    assert set(np.unique(mask)) <= {0.0, 1.0}
    assert mask.sum() > 0


def test_full_size_volume():
    start = time.perf_counter()
    image, mask = make_phantom((160, 256, 256), 0)
    elapsed = time.perf_counter() - start
    assert image.shape == (160, 256, 256) and mask.shape == (160, 256, 256)
    assert image.dtype == np.float32 and mask.dtype == np.float32
    assert 0.0 <= image.min() and image.max() <= 1.0
    assert set(np.unique(mask)) == {0.0, 1.0}
    # a few seconds on one core; the bound only catches a pathological slow-down on a busy machine
    assert elapsed < 30.0, elapsed


def _touches(mask: np.ndarray, region: np.ndarray) -> bool:
    """Whether any voxel of ``mask`` has a face neighbour in ``region``."""
    idx = np.argwhere(mask > 0)
    for offset in np.array([[1, 0, 0], [-1, 0, 0], [0, 1, 0], [0, -1, 0], [0, 0, 1], [0, 0, -1]]):
        n = idx + offset
        if region[n[:, 0], n[:, 1], n[:, 2]].any():
            return True
    return False


@pytest.mark.parametrize("seed", range(4))
def test_mask_is_the_lesion_and_inside_the_head(seed):
    image, mask, labels = make_phantom(SMALL, seed, return_labels=True)
    assert mask.sum() > 0
    assert np.array_equal(mask > 0, labels == LABELS["lesion"])
    idx = np.argwhere(mask > 0)
    assert (idx > 0).all() and (idx < np.array(SMALL) - 1).all()  # off the volume border
    assert not _touches(mask, labels == LABELS["background"])
    # at a resolution where skull and CSF rim are a voxel or more thick, lesions stay inside the skull too
    _, mask, labels = make_phantom(MEDIUM, seed, return_labels=True)
    outside = np.isin(labels, [LABELS["background"], LABELS["scalp"], LABELS["skull"]])
    assert mask.sum() > 0 and not _touches(mask, outside)


@pytest.mark.parametrize("seed", range(6))
def test_lesions_change_the_image(seed):
    image, mask, labels = make_phantom(MEDIUM, seed, return_labels=True)
    white = image[labels == LABELS["white_matter"]].mean()
    lesion = image[mask > 0].mean()
    assert lesion - white > 0.08, (lesion, white)


@pytest.mark.parametrize("seed", range(3))
def test_t1_tissue_ordering(seed):
    image, _, labels = make_phantom(MEDIUM, seed, return_labels=True)
    mean = {name: image[labels == value].mean() for name, value in LABELS.items() if (labels == value).any()}
    assert mean["white_matter"] > mean["grey_matter"] + 0.1
    assert mean["grey_matter"] > mean["csf"] + 0.1
    # ventricles are a few voxels wide here, so partial volume lifts them; still darker than grey matter
    assert mean["grey_matter"] > mean["ventricle"] + 0.03
    assert mean["background"] < 0.1


def test_ventricles_are_dark_at_a_finer_size():
    image, _, labels = make_phantom((64, 64, 64), 0, return_labels=True)
    grey = image[labels == LABELS["grey_matter"]].mean()
    assert image[labels == LABELS["ventricle"]].mean() < grey - 0.1


def test_every_tissue_is_present_at_a_moderate_size():
    _, _, labels = make_phantom((48, 64, 64), 1, return_labels=True)
    present = set(np.unique(labels).tolist())
    assert set(LABELS.values()) - {LABELS["oedema"]} <= present


def test_bad_shape_is_refused():
    with pytest.raises(ConfigError, match="volume_shape"):
        make_phantom((16, 16), 0)
    with pytest.raises(ConfigError, match="volume_shape"):
        make_phantom((16, 0, 16), 0)


def test_dataset_sample_contract():
    ds = PhantomDataset(SMALL, num_subjects=3, seed_offset=10)
    assert len(ds) == 3
    assert ds.subjects == ["phantom-0010", "phantom-0011", "phantom-0012"]
    sample = ds[1]
    assert set(sample) == {"image", "mask", "subject", "affine"}
    assert sample["image"].shape == (1, *SMALL) and sample["image"].dtype == torch.float32
    assert sample["mask"].shape == (1, *SMALL) and sample["mask"].dtype == torch.float32
    assert sample["affine"].dtype == torch.float64 and torch.equal(sample["affine"], torch.eye(4, dtype=torch.float64))
    assert sample["subject"] == "phantom-0011"
    image, mask = make_phantom(SMALL, 11)
    assert np.array_equal(sample["image"][0].numpy(), image)
    assert np.array_equal(sample["mask"][0].numpy(), mask)
    with pytest.raises(IndexError):
        ds[3]


def test_cached_dataset_matches_and_is_not_mutated_by_callers():
    cached = PhantomDataset(SMALL, num_subjects=2, cache=True)
    fresh = PhantomDataset(SMALL, num_subjects=2)
    first = cached[0]
    first["image"].zero_()
    for i in range(2):
        a, b = cached[i], fresh[i]
        assert torch.equal(a["image"], b["image"]) and torch.equal(a["mask"], b["mask"])
