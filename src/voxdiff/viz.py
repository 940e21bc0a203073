"""Pictures and volumes for people: a three-plane montage PNG and NIfTI export, both written atomically.

Volumes are ``(D, H, W)`` (or ``(1, D, H, W)``) in RAS voxel order, as produced by :mod:`voxdiff.data`:
axis 0 left→right, axis 1 posterior→anterior, axis 2 inferior→superior. The montage shows, per column, the
axial (fixed axis 2), coronal (fixed axis 1) and sagittal (fixed axis 0) planes in neurological convention (the
subject's right on the picture's right, anterior/superior up), assuming isotropic voxels: the mid-planes, or the
planes through a given voxel — the samples' montages cut through the largest lesion of their mask
(:func:`lesion_centre`), so that a reader sees whether the lesion was drawn where the mask puts it — or the
maximum-intensity projections along the same axes (:func:`projections`), where every lesion of a mask shows: the
montages of generated masks (``mode=seg``), whose lesions no single plane holds.
"""

from __future__ import annotations

import gzip
import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch

from voxdiff.files import atomic_write

#: row names of the montage, top to bottom
PLANES = ("axial", "coronal", "sagittal")


def _as_volume(volume: np.ndarray | torch.Tensor, name: str) -> np.ndarray:
    """``(D, H, W)`` or ``(1, D, H, W)`` array/tensor → ``(D, H, W)`` float32 numpy array."""
    if isinstance(volume, torch.Tensor):
        volume = volume.detach().to("cpu", torch.float32).numpy()
    array = np.asarray(volume, dtype=np.float32)
    if array.ndim == 4 and array.shape[0] == 1:
        array = array[0]
    if array.ndim != 3:
        raise ValueError(f"{name}: expected a (D, H, W) or (1, D, H, W) volume, got shape {tuple(array.shape)}")
    return array


def mid_planes(volume: np.ndarray | torch.Tensor,
               centre: tuple[int, int, int] | None = None) -> dict[str, np.ndarray]:
    """The three planes of a volume through ``centre`` (None: the mid-planes), oriented for
    ``imshow(..., origin="lower")``.

    Args:
        volume: ``(D, H, W)`` or ``(1, D, H, W)``.
        centre: ``(d, h, w)`` voxel the planes pass through, clipped to the volume.

    Returns:
        ``{"axial": (H, D), "coronal": (W, D), "sagittal": (W, H)}`` float32 arrays (rows = vertical axis).
    """
    v = _as_volume(volume, "volume")
    d, h, w = v.shape
    cd, ch, cw = centre if centre is not None else (d // 2, h // 2, w // 2)
    cd, ch, cw = min(max(cd, 0), d - 1), min(max(ch, 0), h - 1), min(max(cw, 0), w - 1)
    return {
        "axial": v[:, :, cw].T,
        "coronal": v[:, ch, :].T,
        "sagittal": v[cd, :, :].T,
    }


def projections(volume: np.ndarray | torch.Tensor) -> dict[str, np.ndarray]:
    """The maximum-intensity projections of a volume along the axes :func:`mid_planes` fixes, oriented as its planes
    (``{"axial": (H, D), "coronal": (W, D), "sagittal": (W, H)}`` float32): every voxel above the background shows
    in each, wherever it lies (a mask's every lesion)."""
    v = _as_volume(volume, "volume")
    return {"axial": v.max(axis=2).T, "coronal": v.max(axis=1).T, "sagittal": v.max(axis=0).T}


def label_lesions(lesion: np.ndarray) -> tuple[np.ndarray, int]:
    """``(labels, n)``: the lesions of a binarised mask ``(D, H, W)`` bool, each a 26-connected component (voxels
    touching by a face, an edge or a corner), numbered 1..n in ``labels`` (SciPy's ``ndimage.label``). The one
    definition of a lesion: the montages' planes (:func:`lesion_centre`) and the lesion figures
    (:func:`voxdiff.evaluation.lesions.lesion_table`) both count by it."""
    from scipy import ndimage  # deferred: only masks need it

    return ndimage.label(lesion, structure=ndimage.generate_binary_structure(3, 3))


def lesion_centre(mask: np.ndarray | torch.Tensor) -> tuple[int, int, int] | None:
    """The voxel at the centre of mass of the largest lesion of a mask (:func:`label_lesions`; None for an empty
    mask).

    Args:
        mask: ``(D, H, W)`` or ``(1, D, H, W)``, lesion where > 0.5.
    """
    from scipy import ndimage  # deferred: only montages of masks need it

    labels, n = label_lesions(_as_volume(mask, "mask") > 0.5)
    if n == 0:
        return None
    sizes = np.bincount(labels.ravel())[1:]
    largest = labels == (int(np.argmax(sizes)) + 1)
    return tuple(int(round(c)) for c in ndimage.center_of_mass(largest))  # type: ignore[return-value]


def save_montage(
    path: str | os.PathLike[str],
    columns: Mapping[str, np.ndarray | torch.Tensor],
    title: str | None = None,
    centre: tuple[int, int, int] | None = None,
    project: bool = False,
) -> Path:
    """Write a PNG montage: one column per volume, rows = axial, coronal, sagittal planes (through ``centre``, a
    ``(d, h, w)`` voxel of every column's volume; None: the mid-planes), or with ``project`` the maximum-intensity
    projections along those axes (:func:`projections`; ``centre`` is then not used).

    Every panel uses the grey colour map with a fixed [0, 1] window (images are in [0, 1], masks in {0, 1}),
    so columns and successive montages are comparable; values outside are clipped by the display only.

    Args:
        path: the PNG to write (parent folders are created; written atomically, :func:`voxdiff.files.atomic_write`).
        columns: ``{name: volume}``, each ``(D, H, W)`` or ``(1, D, H, W)`` numpy array or tensor, e.g.
            ``{"mask": ..., "real": ..., "generated": ...}``. Shapes may differ between columns.
        title: an optional figure title.

    Returns:
        The path written.
    """
    # the Agg canvas directly, no pyplot: no global backend switch, no figure registry, safe in threads
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if not columns:
        raise ValueError("save_montage needs at least one column")
    planes = {name: projections(_as_volume(vol, name)) if project else mid_planes(_as_volume(vol, name), centre)
              for name, vol in columns.items()}
    # one picture of every panel, drawn by one imshow (an Axes per panel cost most of a montage's time): each column
    # as wide as its widest plane, each row as tall as its tallest (planes keep their voxel aspect, centred in
    # their cell on the black background), a few voxels between cells
    col_w = [max(p[k].shape[1] for k in PLANES) for p in planes.values()]
    row_h = [max(p[k].shape[0] for p in planes.values()) for k in PLANES]
    gap_w, gap_h = max(1, round(0.04 * sum(col_w) / len(col_w))), max(1, round(0.04 * sum(row_h) / len(row_h)))
    x0 = np.cumsum([0] + [w + gap_w for w in col_w])  # each column's left edge, in voxels
    y0 = np.cumsum([0] + [h + gap_h for h in row_h])  # each row's top edge
    canvas = np.zeros((int(y0[-1]) - gap_h, int(x0[-1]) - gap_w), np.float32)
    for j, p in enumerate(planes.values()):
        for i, plane in enumerate(PLANES):
            panel = np.clip(p[plane][::-1], 0.0, 1.0)  # rows top to bottom: the planes are oriented for origin "lower"
            r = int(y0[i]) + (row_h[i] - panel.shape[0]) // 2  # the panel's first row and column in the canvas
            c = int(x0[j]) + (col_w[j] - panel.shape[1]) // 2
            canvas[r : r + panel.shape[0], c : c + panel.shape[1]] = panel
    scale = 3.0 / max(max(col_w), max(row_h))  # inches per voxel: the largest panel is about 3 inches
    height, width = canvas.shape
    fig_w = width * scale + 0.6
    fig_h = height * scale + (0.9 if title else 0.5)
    fig = Figure(figsize=(fig_w, fig_h), dpi=100, facecolor="black")
    FigureCanvasAgg(fig)
    left, bottom = 0.5 / fig_w, 0.1 / fig_h
    ax = fig.add_axes((left, bottom, width * scale / fig_w, height * scale / fig_h))
    ax.imshow(canvas, cmap="gray", vmin=0.0, vmax=1.0, interpolation="nearest", aspect="auto")
    ax.set_axis_off()
    top = bottom + height * scale / fig_h
    for j, name in enumerate(planes):  # column names above, plane names at the left, as axis titles and labels
        fig.text(left + (x0[j] + col_w[j] / 2) * scale / fig_w, top + 0.06 / fig_h, name, color="white",
                 fontsize=11, ha="center", va="bottom")
    for i, plane in enumerate(PLANES):
        fig.text(left - 0.08 / fig_w, top - (y0[i] + row_h[i] / 2) * scale / fig_h, plane, color="white",
                 fontsize=10, ha="right", va="center", rotation=90)
    if title:
        fig.suptitle(title, color="white", fontsize=12)
    return atomic_write(path, lambda f: fig.savefig(f, format="png", facecolor=fig.get_facecolor()))


def save_nifti(
    path: str | os.PathLike[str],
    volume: np.ndarray | torch.Tensor,
    affine: np.ndarray | torch.Tensor,
) -> Path:
    """Write a volume as a float32 NIfTI-1 file (``.nii`` or ``.nii.gz``) with the given voxel-to-RAS affine.

    Args:
        path: the file to write; ``.nii.gz`` is gzip-compressed. Written atomically
            (:func:`voxdiff.files.atomic_write`).
        volume: ``(D, H, W)`` or ``(1, D, H, W)`` array or tensor.
        affine: ``(4, 4)`` voxel → world (RAS, mm) matrix, e.g. a sample's ``"affine"``.

    Returns:
        The path written.
    """
    import nibabel as nib
    from nibabel.openers import Opener

    name = Path(path).name
    if name.endswith(".nii.gz"):
        suffix = ".nii.gz"
    elif name.endswith(".nii"):
        suffix = ".nii"
    else:
        raise ValueError(f"save_nifti: {path} must end with .nii or .nii.gz")
    data = _as_volume(volume, "volume")
    if isinstance(affine, torch.Tensor):
        affine = affine.detach().cpu().numpy()
    aff = np.asarray(affine, dtype=np.float64)
    if aff.shape != (4, 4):
        raise ValueError(f"save_nifti: affine must be (4, 4), got {aff.shape}")
    image = nib.Nifti1Image(data, aff)
    image.set_qform(aff, code=1)
    image.set_sform(aff, code=1)
    image.header.set_data_dtype(np.float32)
    payload = image.to_bytes()
    if suffix == ".nii.gz":  # nibabel's own compression level for .gz files
        payload = gzip.compress(payload, compresslevel=Opener.default_compresslevel, mtime=0)
    return atomic_write(path, lambda f: f.write(payload))
