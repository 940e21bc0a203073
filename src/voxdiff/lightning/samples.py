"""Write generated volumes for people: NIfTI with the source affine and a mid-plane montage PNG per sample.

Used by the system's validation sampling and by ``sample.py``, so both write the same files:

* ``<tag>_<subject>_generated.nii.gz``: the generated image (bravo) or mask (seg), float32, the source affine;
* ``<tag>_<subject>.png``: three planes per column, ``mask | real | generated`` through the mask's largest lesion
  (bravo), or the three maximum-intensity projections of ``real mask | generated mask`` (seg: every lesion shows);
* ``<tag>_<subject>_covariates.json`` (a model trained with covariates): the covariate values it was sampled at.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch

from voxdiff.files import atomic_write
from voxdiff.viz import lesion_centre, save_montage, save_nifti


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", str(name)).strip("_") or "sample"


def save_samples(
    out_dir: str | Path,
    tag: str,
    mode: str,
    generated: torch.Tensor,
    masks: torch.Tensor,
    images: torch.Tensor | None,
    affines: Sequence[np.ndarray] | torch.Tensor,
    subjects: Sequence[str],
    covariates: Sequence[Mapping[str, object]] | None = None,
) -> list[Path]:
    """Write one NIfTI and one montage per sample (and the covariates it was sampled at); returns the montage paths.

    Args:
        out_dir: the folder (created).
        tag: file-name prefix, e.g. ``epoch0004_step000120``.
        mode: ``bravo`` or ``seg``.
        generated: ``(B, 1, D, H, W)`` generated images in [0, 1] (bravo) or masks in {0, 1} (seg).
        masks: ``(B, 1, D, H, W)`` the real (conditioning) masks.
        images: ``(B, 1, D, H, W)`` the real images (bravo montage), or None.
        affines: ``B`` voxel-to-world ``(4, 4)`` matrices of the source volumes.
        subjects: ``B`` subject names.
        covariates: ``B`` mappings of the covariate values each sample was generated at, or None (no covariates).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pngs = []
    for i in range(generated.shape[0]):
        stem = f"{_safe(tag)}_{_safe(subjects[i])}"
        affine = affines[i]
        affine = affine.detach().cpu().double().numpy() if isinstance(affine, torch.Tensor) else np.asarray(affine)
        save_nifti(out / f"{stem}_generated.nii.gz", generated[i, 0].float().cpu(), affine)
        if covariates is not None:
            text = json.dumps({"subject": str(subjects[i]), "covariates": dict(covariates[i])}, indent=1) + "\n"
            atomic_write(out / f"{stem}_covariates.json", lambda f, t=text: f.write(t.encode()))
        if mode == "bravo":
            columns = {"mask": masks[i, 0], "real": images[i, 0] if images is not None else None,
                       "generated": generated[i, 0]}
        else:
            columns = {"real mask": masks[i, 0], "generated mask": generated[i, 0]}
        columns = {k: v.float().cpu() for k, v in columns.items() if v is not None}
        # bravo: the planes through the mask's largest lesion, where the generated one should be; seg: projections,
        # where every lesion of both masks shows (the generated mask's lie anywhere)
        centre = lesion_centre(masks[i, 0]) if mode == "bravo" else None
        where = ("maximum-intensity projections" if mode != "bravo" else
                 "through the largest lesion" if centre is not None else "mid-planes")
        pngs.append(save_montage(out / f"{stem}.png", columns, title=f"{tag}  {subjects[i]}  ({mode}, {where})",
                                 centre=centre, project=mode != "bravo"))
    return pngs
