"""A real brain, offline: subjects made from MRI templates that ship inside packages (``data=mni_template``).

Templates (nothing is downloaded at run time):

* ``mni152_2009`` (default): the ICBM 2009 symmetric non-linear MNI152 T1 template (197×233×189, 1 mm) and its
  white-matter probability map, read from nilearn's wheel (``nilearn.datasets.load_mni152_template``,
  ``load_mni152_wm_template``). Copyright (C) 1993–2009 Louis Collins, McConnell Brain Imaging Centre, Montreal
  Neurological Institute, McGill University; permission to use, copy, modify and distribute for any purpose and
  without fee, provided that the notice appears in all copies.
* ``colin27``: the brain-extracted Colin27 T1 (``ch2bet``, 181×217×181, 1 mm) of Debian's ``mricron-data``
  (``apt-get install mricron-data``; its copyright file puts the package under BSD-3-clause). It has no tissue
  maps, so the white matter is taken as the brightest 30% of brain voxels (white matter is the brightest tissue
  on T1).

Each subject is the template resampled to ``voxel_mm`` (isotropic, RAS), deformed by a random affine and a random
elastic field (MONAI ``RandAffine``, ``Rand3DElastic``; the image and the white-matter map move together), given a
smooth bias field and Rician noise (MONAI ``RandBiasField``, ``RandRicianNoise``), and 1–3 lesions: ellipsoids
centred in white matter, clipped to it, that enhance (a bright rim, a dark necrotic core when large). Subjects are
written once as ``bravo.nii.gz`` / ``seg.nii.gz`` folders under ``out_dir`` (keyed by every setting) and then
served by :class:`~voxdiff.data.VolumeDataModule` through the real NIfTI path (load, orient to RAS, scale
intensities, binarise the mask, pad/crop to ``volume_shape``). Deterministic per subject.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from voxdiff.data.datamodule import VolumeDataModule
from voxdiff.data.shared import one_writes
from voxdiff.errors import ConfigError, integer, number, one_of
from voxdiff.files import atomic_write
from voxdiff.viz import save_nifti

TEMPLATES = ("mni152_2009", "colin27")
#: where Debian's mricron-data installs Colin27
COLIN27_FILE = Path("/usr/share/mricron/templates/ch2bet.nii.gz")
#: bump when the subject recipe changes, so old folders are not reused
_RECIPE_VERSION = 1


def load_template(name: str) -> tuple[Any, Any]:
    """The 1 mm template T1 and white-matter probability map of ``name`` as nibabel images.

    Raises:
        ConfigError: an unknown template, or Colin27 when mricron-data is not installed (named as
            ``data.template``).
    """
    import nibabel as nib

    if name == "mni152_2009":
        from nilearn import datasets

        return datasets.load_mni152_template(resolution=1), datasets.load_mni152_wm_template(resolution=1)
    if name == "colin27":
        if not COLIN27_FILE.is_file():
            raise ConfigError("data.template", name, f"{COLIN27_FILE} is missing",
                              "install Debian's mricron-data (apt-get install mricron-data) or use "
                              "data.template=mni152_2009")
        t1 = nib.load(COLIN27_FILE)
        data = np.asarray(t1.dataobj, dtype=np.float32)
        brain = data > 0
        wm = (data > np.percentile(data[brain], 70)) & brain
        return t1, nib.Nifti1Image(wm.astype(np.float32), t1.affine)
    raise ConfigError("data.template", name, "unknown template", f"use one of {', '.join(TEMPLATES)}")


@functools.lru_cache(maxsize=4)
def resampled_template(name: str, voxel_mm: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The template at ``voxel_mm`` isotropic in RAS: ``(T1 (X, Y, Z) in [0, 1], WM probability (X, Y, Z),
    affine (4, 4))``."""
    import nibabel as nib
    from nilearn.image import resample_img

    t1, wm = load_template(name)
    t1, wm = nib.as_closest_canonical(t1), nib.as_closest_canonical(wm)  # RAS voxel order
    target = np.diag([voxel_mm, voxel_mm, voxel_mm, 1.0])
    target[:3, 3] = t1.affine[:3, 3]
    extent = np.array(t1.shape[:3]) * np.abs(np.diag(t1.affine)[:3])
    shape = tuple(int(np.ceil(e / voxel_mm)) for e in extent)
    kwargs = {"target_affine": target, "target_shape": shape, "force_resample": True, "copy_header": True}
    t1_r = resample_img(t1, interpolation="continuous", **kwargs)
    wm_r = resample_img(wm, interpolation="linear", **kwargs)
    image = np.clip(np.asarray(t1_r.dataobj, dtype=np.float32), 0, None)
    image /= max(float(np.percentile(image[image > 0], 99.5)), 1e-6)
    return np.clip(image, 0, 1), np.clip(np.asarray(wm_r.dataobj, dtype=np.float32), 0, 1), target


def make_subject(template: str, voxel_mm: float, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """One subject: ``(T1 (X, Y, Z) float32, lesion mask (X, Y, Z) in {0, 1}, its white-matter probability
    (X, Y, Z), affine (4, 4))``; lesions lie where the white-matter probability exceeds 0.3."""
    import torch
    from monai.transforms import Compose, Rand3DElasticd, RandAffined, RandBiasFieldd, RandRicianNoised

    base, wm, affine = resampled_template(template, voxel_mm)
    mm = 1.0 / voxel_mm  # voxels per mm
    spatial = Compose([
        RandAffined(["image", "wm"], prob=1.0, rotate_range=(0.12, 0.12, 0.12), scale_range=(0.08, 0.08, 0.08),
                    translate_range=(4 * mm, 4 * mm, 4 * mm), mode="bilinear", padding_mode="zeros"),
        Rand3DElasticd(["image", "wm"], prob=1.0, sigma_range=(12 * mm, 16 * mm), magnitude_range=(40 * mm, 80 * mm),
                       mode="bilinear", padding_mode="zeros"),
        RandBiasFieldd("image", prob=1.0, coeff_range=(0.0, 0.15)),
    ])
    spatial.set_random_state(seed=seed)
    out = spatial({"image": torch.from_numpy(base[None]), "wm": torch.from_numpy(wm[None])})
    image = np.asarray(out["image"][0], dtype=np.float32)
    wm_s = np.asarray(out["wm"][0], dtype=np.float32)
    rng = np.random.default_rng(seed)
    mask = np.zeros_like(image, dtype=bool)
    candidates = np.argwhere(wm_s > 0.9)
    wm_level = float(np.median(image[wm_s > 0.9])) if len(candidates) else 0.8
    grid = np.indices(image.shape, dtype=np.float32)
    for _ in range(int(rng.integers(1, 4)) if len(candidates) else 0):
        centre = candidates[rng.integers(len(candidates))]
        semi = rng.uniform(5.0, 12.0, size=3) * mm  # semi-axes: 5-12 mm
        d = np.sqrt(sum(((grid[k] - centre[k]) / semi[k]) ** 2 for k in range(3)))
        lesion = (d <= 1.0) & (wm_s > 0.3)
        mask |= lesion
        core = 0.5 * wm_level if semi.max() > 9.0 * mm else 1.3 * wm_level  # necrotic if large, else solid
        value = np.where(d > 0.6, 1.35 * wm_level, core)
        image = np.where(lesion, value * rng.uniform(0.95, 1.05), image)
    noise = RandRicianNoised("image", prob=1.0, std=0.03, relative=False, channel_wise=False)
    noise.set_random_state(seed=seed + 1)
    image = np.asarray(noise({"image": torch.from_numpy(image[None].astype(np.float32))})["image"][0])
    return np.clip(image, 0, 1.5).astype(np.float32), mask.astype(np.float32), wm_s, affine


def _settings(template: str, voxel_mm: float, num_subjects: int, seed: int) -> dict[str, Any]:
    return {"template": template, "voxel_mm": float(voxel_mm), "num_subjects": int(num_subjects), "seed": int(seed),
            "recipe": _RECIPE_VERSION}


def subject_root(out_dir: str | os.PathLike[str], template: str, voxel_mm: float, num_subjects: int,
                 seed: int) -> Path:
    """The folder of the subject folders of these settings (keyed by all of them)."""
    key = hashlib.sha1(json.dumps(_settings(template, voxel_mm, num_subjects, seed), sort_keys=True).encode())
    return Path(out_dir).expanduser() / f"{template}-{voxel_mm:g}mm-n{num_subjects}-{key.hexdigest()[:10]}"


def subject_folder(out_dir: str | os.PathLike[str], template: str, voxel_mm: float, num_subjects: int,
                   seed: int) -> Path:
    """Write the subjects (once; existing complete ones are kept) and return the folder of subject folders.

    In a multi-process run the node's rank 0 writes them and the other ranks wait for ``settings.json``, written
    last (:func:`voxdiff.data.shared.one_writes`); every file is written atomically."""
    settings = _settings(template, voxel_mm, num_subjects, seed)
    root = subject_root(out_dir, template, voxel_mm, num_subjects, seed)

    def write() -> None:
        for i in range(num_subjects):
            folder = root / f"{template}-{i:04d}"
            if (folder / "bravo.nii.gz").is_file() and (folder / "seg.nii.gz").is_file():
                continue
            image, mask, _, affine = make_subject(template, float(voxel_mm), int(seed) * 100_003 + i)
            save_nifti(folder / "seg.nii.gz", mask, affine)
            save_nifti(folder / "bravo.nii.gz", image, affine)  # last: its presence marks a complete subject
        atomic_write(root / "settings.json", lambda f: f.write((json.dumps(settings, indent=2) + "\n").encode()))

    one_writes(write, (root / "settings.json").is_file, f"the {num_subjects} template subjects in {root}")
    return root


class MNITemplateDataModule(VolumeDataModule):
    """:class:`~voxdiff.data.VolumeDataModule` over subjects made from a packaged template (see the module doc).

    Args:
        volume_shape: ``(D, H, W)`` every volume is padded/cropped to (``data.volume_shape``).
        template: ``mni152_2009`` or ``colin27``.
        voxel_mm: isotropic voxel size the template is resampled to (3 mm puts the brain in about 48×64×56).
        num_subjects: subjects to make (seeds ``seed·100003 + 0 … num_subjects-1``).
        seed: seed of the augmentations and lesions.
        out_dir: where the subject folders are written (``paths.cache_dir``).
        **kwargs: the other :class:`~voxdiff.data.VolumeDataModule` arguments (split, batch size, cache, ...).
    """

    path_args = (*VolumeDataModule.path_args, "out_dir")  # out_dir: written (the subjects)

    def __init__(self, volume_shape: Any, template: str = "mni152_2009", voxel_mm: float = 3.0,
                 num_subjects: int = 8, seed: int = 0, out_dir: str | os.PathLike[str] = "cache/mni_template",
                 **kwargs: Any) -> None:
        one_of("data.template", template, TEMPLATES)
        number("data.voxel_mm", voxel_mm, lo=0.5, hi=8, example=3)  # mm
        integer("data.num_subjects", num_subjects, minimum=2, fix="e.g. data.num_subjects=8 (1 train + 1 validation "
                "at least)")
        integer("data.seed", seed, minimum=0, example=0)
        self.template, self.voxel_mm, self.seed = template, float(voxel_mm), seed
        root = subject_folder(out_dir, template, float(voxel_mm), num_subjects, seed)
        super().__init__(volume_shape, root=root, num_subjects=num_subjects, **kwargs)
