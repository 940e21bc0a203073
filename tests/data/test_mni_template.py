"""A real brain through the real NIfTI path: subjects made from the MNI152 2009 template in nilearn's wheel, and
nibabel's real T1 (anatomical.nii, LAS) for orientation, crop/pad and the affine of written samples."""

import nibabel as nib
import numpy as np
import pytest
import torch
from nibabel.testing import data_path
from voxdiff.config import compose
from voxdiff.data.mni_template import MNITemplateDataModule, resampled_template
from voxdiff.data.nifti import NiftiDataset
from voxdiff.errors import ConfigError
from voxdiff.lightning.samples import save_samples

VOXEL = 4.0  # mm: a 50x59x48 template grid, cheap to deform
SHAPE = (40, 48, 40)


@pytest.fixture(scope="module")
def dm(tmp_path_factory):
    dm = MNITemplateDataModule(SHAPE, voxel_mm=VOXEL, num_subjects=3, out_dir=tmp_path_factory.mktemp("mni"))
    dm.setup("fit")
    return dm


def test_subjects_are_real_brains_with_white_matter_lesions(dm):
    sample = dm.train_dataset[0]
    image, mask = sample["image"][0], sample["mask"][0]
    assert image.shape == SHAPE and mask.shape == SHAPE
    assert 0.0 <= float(image.min()) and float(image.max()) <= 1.0
    assert set(torch.unique(mask).tolist()) == {0.0, 1.0}
    lesion = image[mask > 0]
    assert lesion.numel() > 0
    # the lesion changes the intensity: it differs from the tissue right around it (enhancing or necrotic)
    shell = image[(torch.nn.functional.max_pool3d(mask[None, None], 5, 1, 2)[0, 0] > 0) & (mask == 0)]
    assert abs(float(lesion.mean()) - float(shell.mean())) > 0.05
    assert (image > 0.2).float().mean() > 0.15  # a brain fills the volume, not a blob


def test_lesions_are_drawn_inside_white_matter():
    from voxdiff.data.mni_template import make_subject

    base, wm, affine = resampled_template("mni152_2009", VOXEL)
    assert np.allclose(np.diag(affine)[:3], VOXEL) and nib.aff2axcodes(affine) == ("R", "A", "S")
    image, mask, wm_subject, _ = make_subject("mni152_2009", VOXEL, seed=7)
    assert mask.sum() > 0 and image.shape == base.shape
    assert wm_subject[mask > 0].min() > 0.3  # inside this subject's (deformed) white matter
    assert abs(float(image[mask > 0].mean()) - float(np.median(image[wm_subject > 0.9]))) > 0.1
    again, mask2, _, _ = make_subject("mni152_2009", VOXEL, seed=7)
    np.testing.assert_array_equal(mask, mask2)  # deterministic per subject
    np.testing.assert_allclose(image, again)
    other, _, _, _ = make_subject("mni152_2009", VOXEL, seed=8)
    assert np.abs(other - image).mean() > 0.01  # another subject: another deformation


def test_the_config_group_builds_it(tmp_path):
    cfg = compose("train", ["experiment=demo", "data=mni_template", "data.volume_shape=[48,64,64]",
                            f"paths.cache_dir={tmp_path}"])  # the README's command: the brain fits 48x64x64 at 3 mm
    assert cfg.data._target_.endswith("MNITemplateDataModule") and list(cfg.data.volume_shape) == [48, 64, 64]
    with pytest.raises(ConfigError) as e:
        MNITemplateDataModule(SHAPE, template="talairach", out_dir=tmp_path)
    assert e.value.key == "data.template"


def _reoriented_copy(src: nib.Nifti1Image, codes: str) -> nib.Nifti1Image:
    now = nib.orientations.io_orientation(src.affine)
    target = nib.orientations.axcodes2ornt(tuple(codes))
    return src.as_reoriented(nib.orientations.ornt_transform(now, target))


def _subject(folder, image, mask):
    folder.mkdir(parents=True)
    nib.save(image, folder / "bravo.nii.gz")
    nib.save(mask, folder / "seg.nii.gz")
    return {"subject": folder.name, "image": str(folder / "bravo.nii.gz"), "mask": str(folder / "seg.nii.gz")}


def test_another_orientation_reaches_the_same_ras_volume(dm, tmp_path):
    record = dm._records[0]
    image, mask = nib.load(record["image"]), nib.load(record["mask"])
    lps = _subject(tmp_path / "lps", _reoriented_copy(image, "LPI"), _reoriented_copy(mask, "LPI"))
    assert nib.aff2axcodes(nib.load(lps["image"]).affine) == ("L", "P", "I")
    a, b = NiftiDataset([record], SHAPE, cache="none")[0], NiftiDataset([lps], SHAPE, cache="none")[0]
    torch.testing.assert_close(a["image"], b["image"])
    torch.testing.assert_close(a["mask"], b["mask"])
    torch.testing.assert_close(a["affine"], b["affine"])


def test_nibabels_real_t1_is_oriented_cropped_padded_and_written_with_its_affine(tmp_path):
    src = nib.load(data_path / "anatomical.nii")  # 33x41x25, 2 mm, LAS
    assert nib.aff2axcodes(src.affine) == ("L", "A", "S")
    data = np.asarray(src.dataobj, dtype=np.float32)
    mask = np.zeros_like(data)
    mask[10:14, 15:20, 10:13] = 1
    record = _subject(tmp_path / "anat", nib.Nifti1Image(data, src.affine), nib.Nifti1Image(mask, src.affine))
    shape = (30, 48, 24)  # crop axis 0 and 2, pad axis 1
    sample = NiftiDataset([record], shape, cache="none")[0]
    assert tuple(sample["image"].shape[1:]) == shape
    affine = sample["affine"].numpy()
    assert nib.aff2axcodes(affine) == ("R", "A", "S")
    # every voxel of the sample shows the source voxel at the same world position (or padding outside it)
    canonical = nib.as_closest_canonical(nib.Nifti1Image(mask, src.affine))
    source_mask = np.asarray(canonical.dataobj)
    out_mask = sample["mask"][0].numpy()
    rng = np.random.default_rng(0)
    for ijk in rng.integers(0, shape, size=(200, 3)):
        world = affine @ np.append(ijk, 1.0)
        src_ijk = np.rint(np.linalg.solve(canonical.affine, world)[:3]).astype(int)
        inside = all(0 <= c < n for c, n in zip(src_ijk, source_mask.shape))
        assert out_mask[tuple(ijk)] == (source_mask[tuple(src_ijk)] if inside else 0.0)
    assert out_mask.sum() == mask.sum()  # the lesion lies inside the cropped field of view
    # a generated volume written with the sample's affine overlays the source in world space
    generated = sample["image"][None]
    save_samples(tmp_path / "out", "t", "bravo", generated, sample["mask"][None], sample["image"][None],
                 [sample["affine"]], ["anat"])
    written = nib.load(tmp_path / "out" / "t_anat_generated.nii.gz")
    np.testing.assert_allclose(written.affine, affine, atol=1e-6)
    centre = affine @ np.array([15, 24, 12, 1.0])
    np.testing.assert_allclose(np.linalg.solve(written.affine, centre)[:3], [15, 24, 12], atol=1e-6)


def test_colin27_without_mricron_data_is_refused_with_the_install_command(monkeypatch, tmp_path):
    import voxdiff.data.mni_template as mni

    monkeypatch.setattr(mni, "COLIN27_FILE", tmp_path / "ch2bet.nii.gz")
    with pytest.raises(ConfigError) as e:
        mni.load_template("colin27")
    assert e.value.key == "data.template" and "apt-get install mricron-data" in str(e.value)
