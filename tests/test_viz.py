"""Montage PNGs and NIfTI export: valid files, the right planes, exact round trips, atomic writes."""

import matplotlib.image as mpimg
import nibabel as nib
import numpy as np
import pytest
import torch
from voxdiff.viz import label_lesions, lesion_centre, mid_planes, projections, save_montage, save_nifti

SHAPE = (16, 24, 20)


def _volume(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).uniform(0, 1, SHAPE).astype(np.float32)


def test_montage_png_is_valid_and_sized(tmp_path):
    path = tmp_path / "out" / "montage.png"
    columns = {
        "mask": (torch.from_numpy(_volume(0)) > 0.9).float()[None],  # (1, D, H, W) tensor
        "real": _volume(1),  # (D, H, W) array
        "generated": torch.from_numpy(_volume(2) * 3 - 1),  # outside [0, 1]: clipped by the display only
    }
    written = save_montage(path, columns, title="epoch 3")
    assert written == path and path.is_file()
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = mpimg.imread(str(path))
    height, width = pixels.shape[:2]
    assert pixels.ndim == 3 and pixels.shape[2] in (3, 4)
    assert width > height > 200  # three columns side by side, three rows of planes plus a title
    assert pixels[..., :3].std() > 0.05  # not a blank picture
    assert [p.name for p in path.parent.iterdir()] == ["montage.png"]  # no temporary file left behind


def test_montage_overwrites_and_refuses_bad_input(tmp_path):
    path = tmp_path / "m.png"
    save_montage(path, {"a": _volume()})
    save_montage(path, {"a": _volume(), "b": _volume(1)})
    assert mpimg.imread(str(path)).shape[1] > 0
    with pytest.raises(ValueError, match="shape"):
        save_montage(path, {"flat": np.zeros((4, 4))})
    with pytest.raises(ValueError):
        save_montage(path, {})


def test_mid_planes_orientation():
    volume = np.zeros(SHAPE, np.float32)
    d, h, w = SHAPE
    volume[3, 5, w // 2] = 1.0  # on the axial mid-plane
    volume[4, h // 2, 7] = 1.0  # on the coronal mid-plane
    volume[d // 2, 9, 11] = 1.0  # on the sagittal mid-plane
    planes = mid_planes(volume)
    assert planes["axial"].shape == (h, d) and planes["axial"][5, 3] == 1.0
    assert planes["coronal"].shape == (w, d) and planes["coronal"][7, 4] == 1.0
    assert planes["sagittal"].shape == (w, h) and planes["sagittal"][11, 9] == 1.0


def test_the_montage_draws_each_plane_upright_with_the_subject_s_right_on_the_right(tmp_path):
    """In the PNG, each row's panel shows its plane as :func:`mid_planes` orients it: a bright block at the
    subject's right, anterior and superior (high indices of axes 0, 1 and 2) lands in the upper right of the axial
    and coronal panels (right; anterior / superior up) and the upper right of the sagittal one (anterior; superior
    up); the planes cut through the block. The panels are found as the grey bands of the picture, right of the plane
    names."""
    d, h, w = 30, 36, 42
    volume = np.full((d, h, w), 0.4, np.float32)
    volume[20:, 26:, 30:] = 1.0  # right, anterior, superior
    path = save_montage(tmp_path / "m.png", {" ": volume}, centre=(25, 30, 35))
    grey = mpimg.imread(str(path))[..., 0]
    grey = grey[:, 60:]  # right of the plane names (0.5 inch at 100 dpi)
    rows = np.flatnonzero((grey > 0.2).any(axis=1))
    bands = np.split(rows, np.flatnonzero(np.diff(rows) > 1) + 1)  # the three panels, top to bottom
    assert len(bands) == 3
    for band, plane in zip(bands, ("axial", "coronal", "sagittal"), strict=True):
        panel = grey[band[0] : band[-1] + 1]
        panel = panel[:, (panel > 0.2).any(axis=0)]
        bright = np.argwhere(panel > 0.9)
        assert bright.size, plane
        up = bright[:, 0].mean() / panel.shape[0]
        right = bright[:, 1].mean() / panel.shape[1]
        assert up < 0.5 and right > 0.5, (plane, up, right)  # the upper right quarter


def test_the_planes_pass_through_the_largest_lesion():
    """A sample's montage cuts through its mask's largest lesion, wherever it is, not through the middle."""
    mask = np.zeros((20, 24, 28), np.float32)
    mask[2:4, 3:5, 4:6] = 1  # a small lesion
    mask[12:17, 15:20, 20:25] = 1  # the largest, centred at (14, 17, 22)
    assert lesion_centre(mask) == (14, 17, 22)
    assert lesion_centre(np.zeros((4, 4, 4))) is None
    planes = mid_planes(mask, lesion_centre(mask))
    assert planes["axial"].sum() == planes["coronal"].sum() == planes["sagittal"].sum() == 25
    assert mid_planes(mask)["axial"].sum() == 0  # the mid-planes miss both lesions


def test_a_lesion_is_one_definition_for_the_montages_and_the_lesion_figures():
    """Two blocks touching at a corner are one lesion (26-connected) for both the montage's planes and the lesion
    count of evaluate.py: the plane goes through their joint centre, not the larger block's alone."""
    from voxdiff.evaluation.lesions import lesion_table

    mask = np.zeros((12, 12, 12), np.float32)
    mask[1:4, 1:4, 1:4] = 1  # 27 voxels
    mask[4:8, 4:8, 4:8] = 1  # 64, touching the first at the corner (3, 3, 3)-(4, 4, 4) only
    assert label_lesions(mask > 0.5)[1] == 1
    centre = np.argwhere(mask > 0).mean(0)  # (4.46, ...): both blocks, where the larger block's own is 5.5
    assert lesion_centre(mask) == tuple(int(round(c)) for c in centre) == (4, 4, 4)
    assert lesion_table(torch.from_numpy(mask)[None, None]).lesions.tolist() == [1.0]


def test_projections_show_every_lesion_wherever_it_lies(tmp_path):
    """The maximum-intensity projections of a mask hold both of its lesions, off every mid-plane, in the panels
    where the planes would show them; a projected montage draws them (the mid-planes' montage is blank)."""
    mask = np.zeros((20, 24, 28), np.float32)
    mask[2:4, 3:5, 4:6] = 1
    mask[12:17, 15:20, 20:25] = 1
    p = projections(mask)
    assert {k: v.shape for k, v in p.items()} == {k: v.shape for k, v in mid_planes(mask).items()}
    assert p["axial"][3, 2] == 1 and p["axial"][17, 14] == 1  # (h, d): each lesion's axial footprint
    assert p["coronal"].sum() == 2 * 2 + 5 * 5 and p["sagittal"].sum() == 2 * 2 + 5 * 5
    white = {}  # the share of white pixels: the column's name in both, the lesions in the projected montage only
    for project in (False, True):
        path = save_montage(tmp_path / f"{project}.png", {"mask": mask}, project=project)
        white[project] = (mpimg.imread(str(path))[..., :3].min(-1) > 0.9).mean()
    assert white[True] > 2 * white[False]


@pytest.mark.parametrize("suffix", [".nii.gz", ".nii"])
def test_nifti_round_trip(tmp_path, suffix):
    volume = torch.from_numpy(_volume())[None]  # (1, D, H, W)
    affine = torch.tensor(
        [[0.0, -1.2, 0.0, 10.5], [0.9, 0.0, 0.0, -20.25], [0.0, 0.0, 1.5, 3.0], [0.0, 0.0, 0.0, 1.0]],
        dtype=torch.float64,
    )
    path = tmp_path / f"gen{suffix}"
    save_nifti(path, volume, affine)
    img = nib.load(str(path))
    assert img.get_data_dtype() == np.float32
    assert np.array_equal(np.asanyarray(img.dataobj), volume[0].numpy())
    assert np.allclose(img.affine, affine.numpy(), atol=1e-5)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def test_nifti_refuses_bad_input(tmp_path):
    with pytest.raises(ValueError, match=r"\.nii"):
        save_nifti(tmp_path / "x.png", _volume(), np.eye(4))
    with pytest.raises(ValueError, match="affine"):
        save_nifti(tmp_path / "x.nii.gz", _volume(), np.eye(3))
    with pytest.raises(ValueError, match="shape"):
        save_nifti(tmp_path / "x.nii.gz", np.zeros((2, 4, 4, 4)), np.eye(4))
    assert list(tmp_path.iterdir()) == []
