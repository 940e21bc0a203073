"""Volumes for training: the procedural demo phantom and real NIfTI folders, behind one Lightning data module.

Every sample is ``{"image": (1, D, H, W) float32 in [0, 1], "mask": (1, D, H, W) float32 in {0, 1},
"subject": str, "affine": (4, 4) float64}``; batches are the default-collated dicts. ``volume_shape``
``(D, H, W)`` sets the size for phantom and real data alike, and volumes are in RAS voxel order (axis 0
left→right, axis 1 posterior→anterior, axis 2 inferior→superior).

The NIfTI side (MONAI) and the data module (Lightning) are imported on first use, so ``from voxdiff.data
import make_phantom`` stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from voxdiff.data.phantom import LABELS, PhantomDataset, check_volume_shape, make_phantom

if TYPE_CHECKING:
    from voxdiff.data.datamodule import VolumeDataModule
    from voxdiff.data.split import split_subjects
    from voxdiff.data.nifti import DataError, NiftiDataset, build_transforms, check_subject, find_subjects

__all__ = [
    "LABELS",
    "DataError",
    "NiftiDataset",
    "PhantomDataset",
    "VolumeDataModule",
    "build_transforms",
    "check_subject",
    "check_volume_shape",
    "find_subjects",
    "make_phantom",
    "split_subjects",
]

_LAZY = {
    "DataError": "voxdiff.data.nifti",
    "NiftiDataset": "voxdiff.data.nifti",
    "build_transforms": "voxdiff.data.nifti",
    "check_subject": "voxdiff.data.nifti",
    "find_subjects": "voxdiff.data.nifti",
    "VolumeDataModule": "voxdiff.data.datamodule",
    "split_subjects": "voxdiff.data.split",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
