"""Real data: a folder of subject folders, each with an image and a lesion-mask NIfTI.

Layout::

    root/
      subject-001/
        bravo.nii.gz   # the T1 image   (data.image_name)
        seg.nii.gz     # the lesion mask (data.mask_name)
      subject-002/
        ...

Every sub-folder of ``root`` whose name does not start with ``.`` is a subject. Each sample goes through MONAI
transforms: load with nibabel → channel first → reorient to RAS → image scaled to [0, 1] by its 0.5 and 99.5
percentiles, clipped (robust to a few very bright or dark voxels, and per volume, so scanner gain does not
matter; a bright enhancing rim above the 99.5th percentile saturates at 1) → mask binarised (> 0.5 → 1, so
multi-label masks become "any lesion") → symmetric zero pad or centre crop to ``volume_shape`` → float32
tensors. The sample's ``affine`` is the RAS voxel→world matrix of that final ``(D, H, W)`` grid (the
reoriented source affine, shifted by the pad/crop), so a generated volume written with it overlays the source.

Bad input is refused with :class:`DataError` naming the file, and checked up front: :func:`find_subjects` reads
every header (cheap) and checks that each file is complete (for ``.nii.gz`` from the gzip trailer, reading the
whole stream only when the trailer disagrees), so a broken subject stops the run before training starts.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import os
import struct
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from monai.transforms import MapTransform
from torch.utils.data import Dataset

from voxdiff.data.phantom import check_volume_shape
from voxdiff.errors import one_of

log = logging.getLogger(__name__)

IMAGE_NAME = "bravo.nii.gz"
MASK_NAME = "seg.nii.gz"
#: intensity percentiles mapped to 0 and 1 (then clipped)
INTENSITY_PERCENTILES: tuple[float, float] = (0.5, 99.5)
#: image and mask grids must agree to this fraction of the smallest voxel size, everywhere in the volume
GRID_TOLERANCE_VOXELS = 0.1
CACHE_MODES = ("none", "memory", "disk")
# AsDiscrete keeps values >= threshold; the float32 just above 0.5 makes that "> 0.5" for float32 masks
_JUST_ABOVE_HALF = float(np.nextafter(np.float32(0.5), np.float32(1.0)))
#: bump when the transforms change, so old disk caches are not reused
_CACHE_VERSION = 1


class DataError(ValueError):
    """Input data that cannot be used; the message names the offending file or folder and what to change."""


# ------------------------------------------------------------------------------------------------ discovery


def check_cache(cache: Any) -> str:
    """``data.cache``: one of :data:`CACHE_MODES` (read by the data module, and by the run spec for host memory).

    Raises:
        ConfigError: naming the key, the value and a fix.
    """
    return str(one_of("data.cache", cache, CACHE_MODES, fix="e.g. data.cache=memory"))


def find_subjects(
    root: str | os.PathLike[str],
    image_name: str = IMAGE_NAME,
    mask_name: str = MASK_NAME,
    *,
    validate: bool = True,
) -> list[dict[str, str]]:
    """List the subjects under ``root``, sorted by name, and (by default) check every file's header.

    Args:
        root: folder holding one sub-folder per subject.
        image_name: file name of the image inside each subject folder (``data.image_name``).
        mask_name: file name of the mask inside each subject folder (``data.mask_name``).
        validate: also read each header and check readability, completeness, shapes and grids
            (:func:`check_subject`).

    Returns:
        ``[{"subject": folder name, "image": path, "mask": path}, ...]`` sorted by subject name.

    Raises:
        DataError: the root is missing or not a folder, holds no subject folder, a subject lacks its image or
            mask, or (``validate``) a file is unreadable/corrupt or image and mask disagree.
    """
    root_path = Path(root).expanduser()
    if not root_path.exists():
        raise DataError(f"data root {root_path} does not exist; set data.root to the folder of subject folders")
    if not root_path.is_dir():
        raise DataError(f"data root {root_path} is not a folder; set data.root to the folder of subject folders")
    folders = sorted(p for p in root_path.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not folders:
        raise DataError(
            f"data root {root_path} holds no subject folders; expected {root_path}/<subject>/{image_name} "
            f"and {root_path}/<subject>/{mask_name}"
        )
    subjects = []
    for folder in folders:
        record = {"subject": folder.name}
        for key, name, option in (("image", image_name, "data.image_name"), ("mask", mask_name, "data.mask_name")):
            path = folder / name
            if not path.is_file():
                present = ", ".join(sorted(p.name for p in folder.iterdir() if not p.name.startswith("."))) or "nothing"
                raise DataError(
                    f"subject {folder.name}: the {key} file {path} does not exist (the folder holds: {present}); "
                    f"put the {key} there as {name} or set {option} to its file name"
                )
            record[key] = str(path)
        subjects.append(record)
    if validate:
        for record in subjects:
            check_subject(record)
    return subjects


def readable_subjects(root: str | os.PathLike[str], image_name: str | None = None,
                      mask_name: str | None = None) -> list[str] | None:
    """The subject folders under ``root`` as :func:`find_subjects` lists them (headers not read), or None where
    ``root`` cannot be read from this machine (another machine's path; an incomplete folder, which the run itself
    refuses naming the file): what a plan made before the run (the preflight) can know of the data."""
    try:
        return [s["subject"] for s in find_subjects(root, image_name or IMAGE_NAME, mask_name or MASK_NAME,
                                                    validate=False)]
    except (DataError, OSError):
        return None


def _load_header(path: str) -> Any:
    """``nib.load`` (header only, data stays on disk), with any failure re-raised as DataError naming the file."""
    import nibabel as nib

    try:
        return nib.load(path)
    except Exception as exc:  # nibabel raises many types: ImageFileError, gzip.BadGzipFile, EOFError, ...
        raise DataError(f"cannot read NIfTI {path}: {type(exc).__name__}: {exc}") from exc


def _spatial_shape(img: Any, path: str) -> tuple[int, int, int]:
    shape = tuple(int(s) for s in img.shape)
    if len(shape) == 4 and shape[3] == 1:
        shape = shape[:3]
    if len(shape) != 3:
        raise DataError(f"{path} has shape {shape}; expected a 3D volume (X, Y, Z) or (X, Y, Z, 1)")
    return shape  # type: ignore[return-value]


def _check_complete(path: str, img: Any) -> None:
    """Refuse a truncated or corrupt single-file NIfTI without decompressing it when the file is intact.

    The data of a ``.nii`` ends at ``vox_offset + voxels * itemsize``; the file must be at least that long. A
    ``.nii.gz`` stores the uncompressed length (mod 2³²) in its last four bytes; when it matches, the file is
    whole. Otherwise (truncated, or an unusual multi-member gzip) the stream is read through once.
    """
    import nibabel as nib

    if not isinstance(img, (nib.Nifti1Image, nib.Nifti2Image)):
        return  # other formats (e.g. .img/.hdr pairs): the loader still names the file if it fails
    header = img.header
    needed = int(header.get_data_offset()) + int(np.prod(img.shape)) * header.get_data_dtype().itemsize
    if path.endswith(".gz"):
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(size - 4, 0))
            tail = f.read(4)
        if len(tail) == 4 and struct.unpack("<I", tail)[0] == needed % 2**32:
            return
        total = 0
        try:
            with gzip.open(path, "rb") as g:
                while chunk := g.read(1 << 22):
                    total += len(chunk)
        except (EOFError, OSError, zlib.error) as exc:
            raise DataError(f"{path} is a corrupt or truncated gzip file ({type(exc).__name__}: {exc})") from exc
        if total < needed:
            raise DataError(f"{path} is truncated: it holds {total} bytes uncompressed, its header needs {needed}")
    else:
        size = os.path.getsize(path)
        if size < needed:
            raise DataError(f"{path} is truncated: it has {size} bytes, its header needs {needed}")


def _matrix(a: np.ndarray) -> str:
    """A matrix on one line: ``[[1, 0, 0, 0], ...]``."""
    return np.array2string(a, precision=4, separator=", ", max_line_width=10**6).replace("\n", "")


def _affine(img: Any, path: str) -> np.ndarray:
    """The voxel-to-world matrix of a NIfTI header, refused (naming the file) when it is not finite or singular:
    the transforms reorient every volume with it, and nibabel cannot write it back."""
    try:
        a = np.asarray(img.affine, dtype=np.float64)
    except Exception as exc:  # nibabel's HeaderDataError, a LinAlgError while decomposing the quaternion
        raise DataError(f"{path}: its affine cannot be read from the header ({type(exc).__name__}: "
                        f"{' '.join(str(exc).split())}); repair the header's sform/qform") from exc
    if a.shape != (4, 4) or not np.isfinite(a).all():
        raise DataError(f"{path}: its affine (voxel to world, from the header's sform/qform) is not finite: "
                        f"{_matrix(a)}; repair the header, e.g. with nibabel's img.set_sform(affine, code=1)")
    scale = float(np.abs(a[:3, :3]).max())
    if scale == 0 or abs(float(np.linalg.det(a[:3, :3]))) <= 1e-12 * scale**3:
        raise DataError(f"{path}: its affine (voxel to world, from the header's sform/qform) is singular: "
                        f"{_matrix(a)}, so its voxels have no orientation or size; repair the header, e.g. with "
                        "nibabel's img.set_sform(affine, code=1)")
    return a


def check_subject(record: Mapping[str, str]) -> None:
    """Check one subject from its headers: both files readable and complete, same shape, same grid.

    Args:
        record: ``{"subject": ..., "image": path, "mask": path}`` as from :func:`find_subjects`.

    Raises:
        DataError: naming the file(s) and what disagrees.
    """
    image_path, mask_path = str(record["image"]), str(record["mask"])
    for path in (image_path, mask_path):
        if not Path(path).is_file():
            raise DataError(f"subject {record.get('subject', '?')}: {path} does not exist")
    img = _load_header(image_path)
    msk = _load_header(mask_path)
    shape_i = _spatial_shape(img, image_path)
    shape_m = _spatial_shape(msk, mask_path)
    _check_complete(image_path, img)
    _check_complete(mask_path, msk)
    if shape_i != shape_m:
        raise DataError(
            f"image and mask shapes differ: {image_path} is {shape_i}, {mask_path} is {shape_m}; "
            "the mask must be on the image's voxel grid"
        )
    a_i = _affine(img, image_path)
    a_m = _affine(msk, mask_path)
    ends = [(0, s - 1) for s in shape_i]
    corners = np.array([[x, y, z, 1.0] for x in ends[0] for y in ends[1] for z in ends[2]])
    gap = float(np.max(np.linalg.norm((corners @ (a_i - a_m).T)[:, :3], axis=1)))
    voxel = float(np.min(np.linalg.norm(a_i[:3, :3], axis=0)))
    if gap > GRID_TOLERANCE_VOXELS * voxel:
        raise DataError(
            f"image and mask affines differ by up to {gap:.3g} mm (tolerance {GRID_TOLERANCE_VOXELS * voxel:.3g} mm): "
            f"{image_path} has {_matrix(a_i)}, {mask_path} has {_matrix(a_m)}; the mask must be on the image's voxel "
            "grid"
        )


# ------------------------------------------------------------------------------------------------ transforms


def _find_data_error(exc: BaseException) -> DataError | None:
    """The first DataError in an exception's cause/context chain (MONAI wraps transform errors in RuntimeError)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, DataError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return None


def build_transforms(
    volume_shape: Sequence[int], percentiles: tuple[float, float] = INTENSITY_PERCENTILES
) -> Any:
    """The MONAI pipeline ``{"image": path, "mask": path, "subject": str, ...}`` → a contract sample.

    All steps are deterministic MONAI ``Transform``\\ s, so ``CacheDataset``/``PersistentDataset`` cache the
    finished sample.

    Args:
        volume_shape: ``(D, H, W)`` of the output.
        percentiles: image intensities at these percentiles map to 0 and 1 (then clipped).

    Returns:
        A ``monai.transforms.Compose``; its output is ``{"image": (1, D, H, W) float32 in [0, 1], "mask":
        (1, D, H, W) float32 in {0, 1}, "subject": str, "affine": (4, 4) float64}``.
    """
    from monai.transforms import (
        AsDiscreted,
        Compose,
        EnsureChannelFirstd,
        EnsureTyped,
        Orientationd,
        ResizeWithPadOrCropd,
        ScaleIntensityRangePercentilesd,
    )

    keys = ["image", "mask"]
    lower, upper = (float(p) for p in percentiles)
    return Compose(
        [
            _LoadNiftid(keys),
            EnsureChannelFirstd(keys, channel_dim="no_channel"),
            Orientationd(keys, axcodes="RAS", labels=(("L", "R"), ("P", "A"), ("I", "S"))),
            ScaleIntensityRangePercentilesd("image", lower=lower, upper=upper, b_min=0.0, b_max=1.0, clip=True),
            AsDiscreted("mask", threshold=_JUST_ABOVE_HALF),
            ResizeWithPadOrCropd(keys, spatial_size=tuple(int(s) for s in volume_shape), mode="constant"),
            EnsureTyped(keys, dtype=torch.float32, track_meta=True),
            _ToSampled(),
        ]
    )


def _diagnose(path: str, exc: BaseException) -> str:
    """A one-line reason why ``path`` did not load (MONAI's own message lists every reader it tried)."""
    import nibabel as nib

    try:
        np.asanyarray(nib.load(path).dataobj)
    except Exception as direct:  # the reader's own error: EOFError, ImageFileError, ...
        return f"{type(direct).__name__}: {direct}"
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first}"


class _LoadNiftid(MapTransform):
    """``LoadImaged`` (nibabel reader) per key; any failure is re-raised as DataError naming the file.

    Also refuses NaN/inf voxels and images without signal (:func:`check_intensities`). Keeps the input paths under ``"<key>_file"`` for later error messages.
    """

    def __init__(self, keys: Sequence[str]) -> None:
        from monai.transforms import LoadImaged

        super().__init__(list(keys))
        self._loaders = {
            key: LoadImaged(key, reader="NibabelReader", image_only=True, dtype=np.float32) for key in self.keys
        }

    def __call__(self, data: Mapping[str, Any]) -> dict[str, Any]:
        d = dict(data)
        for key in self.keys:
            path = str(d[key])
            d[f"{key}_file"] = path
            try:
                d = self._loaders[key](d)
            except Exception as exc:
                raise DataError(f"cannot load the {key} NIfTI {path}: {_diagnose(path, exc)}") from exc
            volume = d[key]
            if volume.ndim == 4 and volume.shape[-1] == 1:  # (X, Y, Z, 1) → (X, Y, Z)
                d[key] = volume[..., 0]
            check_intensities(d[key], path, blank_ok=key != "image")
        return d


def check_intensities(volume: Any, path: str, blank_ok: bool = False) -> None:
    """Refuse a volume with NaN/inf voxels, or (unless ``blank_ok``: masks may be empty) one without signal.

    Raises:
        DataError: naming the file, the first bad voxel or the constant value, and the fix.
    """
    volume = torch.as_tensor(volume)
    finite = torch.isfinite(volume)
    if not bool(finite.all()):
        bad = int((~finite).sum())
        first = tuple(int(i) for i in torch.nonzero(~finite)[0])
        raise DataError(f"{path} contains {bad} NaN or infinite voxel value(s) (the first at index {first}); fix or "
                        "replace the file, or remove the subject from data.root")
    if not blank_ok and volume.numel() and bool(volume.max() == volume.min()):
        raise DataError(f"{path} has no signal: every voxel is {float(volume.flatten()[0]):g}; fix or replace the "
                        "file, or remove the subject from data.root")


class _ToSampled(MapTransform):
    """MetaTensors → the contract dict of plain tensors, with the RAS affine of the final grid."""

    def __init__(self) -> None:
        super().__init__(["image", "mask"])

    def __call__(self, data: Mapping[str, Any]) -> dict[str, Any]:
        from monai.data import MetaTensor

        image, mask = data["image"], data["mask"]
        affine = image.affine if isinstance(image, MetaTensor) else torch.eye(4)
        as_plain = lambda t: (t.as_tensor() if isinstance(t, MetaTensor) else torch.as_tensor(t))  # noqa: E731
        return {
            "image": as_plain(image).to(torch.float32).contiguous(),
            "mask": as_plain(mask).to(torch.float32).contiguous(),
            "subject": str(data["subject"]),
            "affine": torch.as_tensor(affine).to(torch.float64).clone(),
        }


# ------------------------------------------------------------------------------------------------ dataset


def _stamp(path: str) -> str:
    st = os.stat(path)
    return f"{st.st_size}-{st.st_mtime_ns}"


class NiftiDataset(Dataset):
    """Subjects from NIfTI files as samples of the data contract, optionally cached.

    Sample ``i`` is ``{"image": (1, D, H, W) float32 in [0, 1], "mask": (1, D, H, W) float32 in {0, 1},
    "subject": str, "affine": (4, 4) float64}`` (see the module docstring for the pipeline).

    Args:
        subjects: records ``{"subject", "image", "mask"}``, e.g. from :func:`find_subjects`.
        volume_shape: ``(D, H, W)`` every sample is padded/cropped to.
        cache: ``"none"`` (load every time: MONAI ``Dataset``), ``"memory"`` (load all at construction and keep
            them: ``CacheDataset``) or ``"disk"`` (``PersistentDataset``: each sample is written to ``cache_dir``
            the first time and read from there afterwards, across runs).
        cache_dir: folder for ``cache="disk"``; a sub-folder per pipeline configuration is used, and each
            subject's entry is keyed by its paths, sizes and modification times, so edited files are reloaded.
        percentiles: image intensity percentiles mapped to 0 and 1.
        validate: check every subject's headers first (:func:`check_subject`); skip only if already done.
        cache_workers: threads that fill the memory cache (default: up to 8).

    Raises:
        DataError: a file is missing, unreadable, corrupt, or image and mask disagree (named in the message).
    """

    def __init__(
        self,
        subjects: Sequence[Mapping[str, str]],
        volume_shape: Sequence[int],
        *,
        cache: str = "none",
        cache_dir: str | os.PathLike[str] | None = None,
        percentiles: tuple[float, float] = INTENSITY_PERCENTILES,
        validate: bool = True,
        cache_workers: int | None = None,
    ) -> None:
        from monai.data import CacheDataset, PersistentDataset
        from monai.data import Dataset as MonaiDataset

        self.volume_shape = check_volume_shape(volume_shape)
        if cache not in CACHE_MODES:
            raise ValueError(f"cache must be one of {CACHE_MODES}, got {cache!r}")
        self.records = [dict(r) for r in subjects]
        if validate:
            for record in self.records:
                check_subject(record)
        items = [
            {
                "subject": r["subject"],
                "image": str(r["image"]),
                "mask": str(r["mask"]),
                "stamp": f"{_stamp(r['image'])}/{_stamp(r['mask'])}",
            }
            for r in self.records
        ]
        transform = build_transforms(self.volume_shape, percentiles)
        self.cache = cache
        self.cache_dir: Path | None = None
        try:
            if cache == "memory":
                workers = cache_workers if cache_workers is not None else min(8, os.cpu_count() or 1)
                log.info("loading %d subjects into memory", len(items))
                self._data: Dataset = CacheDataset(
                    items, transform, num_workers=max(1, min(workers, len(items) or 1)), progress=False
                )
            elif cache == "disk":
                if cache_dir is None:
                    raise ValueError("cache='disk' needs a cache_dir")
                key = json.dumps(
                    {"v": _CACHE_VERSION, "shape": list(self.volume_shape), "percentiles": list(percentiles)},
                    sort_keys=True,
                )
                self.cache_dir = Path(cache_dir).expanduser() / f"nifti-{hashlib.sha1(key.encode()).hexdigest()[:12]}"
                self._data = PersistentDataset(items, transform, cache_dir=self.cache_dir, weights_only=True)
            else:
                self._data = MonaiDataset(items, transform)
        except Exception as exc:
            err = _find_data_error(exc)
            if err is not None:
                raise err from exc
            raise

    @classmethod
    def from_root(
        cls,
        root: str | os.PathLike[str],
        volume_shape: Sequence[int],
        image_name: str = IMAGE_NAME,
        mask_name: str = MASK_NAME,
        **kwargs: Any,
    ) -> NiftiDataset:
        """All subjects under ``root`` (see :func:`find_subjects`); ``kwargs`` go to the constructor."""
        records = find_subjects(root, image_name, mask_name, validate=True)
        return cls(records, volume_shape, validate=False, **kwargs)

    @property
    def subjects(self) -> list[str]:
        """Subject names, in index order."""
        return [r["subject"] for r in self.records]

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> dict[str, Any]:
        try:
            return self._data[index]
        except Exception as exc:
            err = _find_data_error(exc)
            if err is not None:
                raise err from exc
            raise
