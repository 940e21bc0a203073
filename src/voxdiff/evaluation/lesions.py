"""What a set of lesion masks is made of, and how near generated volumes come to the training set.

Mask figures (``mode=seg``: the model draws masks): masks ``(N, 1, D, H, W)`` in [0, 1] are binarised at
:data:`MASK_THRESHOLD`; a lesion is a 26-connected component of the binarised voxels
(:func:`voxdiff.viz.label_lesions`).
Per mask, :func:`lesion_table` counts its lesions, their voxels and the voxels outside the real heads; the
evaluation's figures are means over masks and shares of sums over them, generated against real
(:mod:`voxdiff.evaluation.pipeline`). Generated masks come thresholded to {0, 1}
(:func:`voxdiff.diffusion.batch.decode_volume`): the threshold here binarises masks from elsewhere alike.

Nearest training volume (both modes; the memorisation check of Akbar et al. 2023 and Dar et al. 2023): for each
generated volume and each held-out real one, its greatest similarity to any volume of the training split, the
Dice of the binarised masks (``seg``) or Pearson's r of the voxels (``bravo``: the images). A model that copies its
training data draws volumes nearer to it than held-out real volumes are; :func:`nearest_similarity` streams the
training volumes (one chunk in memory at a time).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from voxdiff.evaluation.metrics import head_mask
from voxdiff.viz import label_lesions

#: a mask voxel is lesion where the generated (or real) mask is above this
MASK_THRESHOLD = 0.5
#: the share of the real heads a voxel must lie in to count as inside the population's head
HEAD_VOTE = 0.5
#: similarity measures of :func:`nearest_similarity`
MEASURES = ("dice", "pearson")


@dataclass(frozen=True)
class LesionTable:
    """Per-mask counts of a set of ``N`` masks (each ``(N,)`` float64).

    Attributes:
        lesions: connected lesions (26-connectivity) of the binarised mask.
        voxels: lesion voxels (above :data:`MASK_THRESHOLD`).
        outside: lesion voxels outside the population's head (:func:`population_head`; 0 without one).
        sizes: ``(L,)`` float64, the voxels of each of the set's ``L = lesions.sum()`` lesions, mask by mask (in
            each mask, in the order SciPy numbers its components).
    """

    lesions: torch.Tensor
    voxels: torch.Tensor
    outside: torch.Tensor
    sizes: torch.Tensor

    def __len__(self) -> int:
        return int(self.lesions.shape[0])


def lesion_table(masks: torch.Tensor, head: torch.Tensor | None = None) -> LesionTable:
    """:class:`LesionTable` of ``masks`` ``(N, 1, D, H, W)`` in [0, 1]; ``head`` ``(D, H, W)`` bool: the population's
    head (:func:`population_head`), whose outside counts as misplaced lesion (None: nothing counted outside)."""
    if masks.ndim != 5 or masks.shape[1] != 1:
        raise ValueError(f"lesion_table needs masks (N, 1, D, H, W), got {tuple(masks.shape)}")
    if head is not None and tuple(head.shape) != tuple(masks.shape[2:]):
        raise ValueError(f"lesion_table: head {tuple(head.shape)} is not the masks' {tuple(masks.shape[2:])}")
    binary = masks[:, 0] > MASK_THRESHOLD  # (N, D, H, W)
    labelled = [label_lesions(b.numpy()) for b in binary]
    lesions = torch.tensor([float(n) for _, n in labelled], dtype=torch.float64)
    sizes = [torch.bincount(torch.from_numpy(labels).flatten().long(), minlength=n + 1)[1:] for labels, n in labelled]
    return LesionTable(
        lesions=lesions,
        sizes=torch.cat(sizes).double() if sizes else torch.zeros(0, dtype=torch.float64),
        voxels=binary.flatten(1).sum(1).double(),
        outside=(binary & ~head).flatten(1).sum(1).double() if head is not None else torch.zeros(len(masks),
                                                                                                 dtype=torch.float64),
    )


def size_histogram(sizes: torch.Tensor) -> dict[str, list[int]]:
    """How many of the lesions ``sizes`` ``(L,)`` (voxels each, :attr:`LesionTable.sizes`) fall in each size band
    ``[2^k, 2^(k+1))`` voxels, from 1 voxel up to the band of the largest: ``{"edges": [1, 2, 4, ..., 2^K],
    "lesions": [n_0, ..., n_(K-1)]}`` (no lesion: one empty band ``[1, 2)``). The bands are the same for every set,
    so two sets' histograms differ only in how many bands they reach."""
    top = int(sizes.max()) if sizes.numel() else 1
    bands = max(1, top.bit_length())  # 2^(bands-1) <= top < 2^bands
    band = torch.tensor([max(1, int(v)).bit_length() - 1 for v in sizes.tolist()], dtype=torch.long)  # 2^k <= size
    return {"edges": [2 ** k for k in range(bands + 1)],
            "lesions": torch.bincount(band, minlength=bands).tolist()}


def population_head(images: torch.Tensor) -> torch.Tensor:
    """The voxels ``(D, H, W)`` bool inside at least :data:`HEAD_VOTE` of the heads of real images ``(R, 1, D, H, W)``
    (:func:`voxdiff.evaluation.metrics.head_mask` of each): where a lesion can lie on aligned volumes."""
    return head_mask(images)[:, 0].double().mean(0) >= HEAD_VOTE


def _flat(volumes: torch.Tensor, measure: str) -> torch.Tensor:
    """``(N, 1, D, H, W)`` → ``(N, V)`` float32 rows whose dot products are the measure's numerators: binarised masks
    (dice), or each volume centred and scaled to unit norm (pearson; a constant volume is all zeros)."""
    flat = volumes.reshape(volumes.shape[0], -1)
    if measure == "dice":
        return (flat > MASK_THRESHOLD).float()
    centred = flat.double() - flat.double().mean(1, keepdim=True)
    norm = centred.norm(dim=1, keepdim=True)
    return torch.where(norm > 0, centred / norm.clamp(min=1e-300), 0.0).float()


def similarity(queries: torch.Tensor, others: torch.Tensor, measure: str) -> torch.Tensor:
    """Each query's similarity to each other volume, ``(Q, 1, D, H, W)`` × ``(M, 1, D, H, W)`` → ``(Q, M)`` float64:
    the Dice of the binarised masks (NaN for a query with no lesion voxel: nearness to a training mask means nothing
    for an empty mask) or Pearson's r of the voxels (0 where either is constant)."""
    if measure not in MEASURES:
        raise ValueError(f"similarity: measure {measure!r} is not one of {MEASURES}")
    if tuple(queries.shape[1:]) != tuple(others.shape[1:]):
        raise ValueError(f"similarity: volumes {tuple(queries.shape[1:])} against {tuple(others.shape[1:])}")
    return _flat_similarity(_flat(queries, measure), _flat(others, measure), measure)


def _flat_similarity(q: torch.Tensor, o: torch.Tensor, measure: str) -> torch.Tensor:
    """:func:`similarity` of rows ``(Q, V)`` and ``(M, V)`` made by :func:`_flat`."""
    dots = (q @ o.T).double()  # (Q, M): exact for masks (float32 holds every count up to 2^24 voxels)
    if measure == "pearson":
        return dots.clamp(-1.0, 1.0)
    own = q.sum(1).double()[:, None]  # (Q, 1)
    return torch.where(own > 0, 2 * dots / (own + o.sum(1).double()[None, :]).clamp(min=1), torch.nan)


def nearest_similarity(queries: torch.Tensor, training: Iterable[torch.Tensor], measure: str
                       ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Each query's greatest :func:`similarity` to any training volume, streamed in chunks ``(m, 1, D, H, W)``.

    Returns:
        ``(nearest (Q,) float64, index (Q,) int64 of the nearest training volume, training volumes seen)``; NaN and
        -1 for a query without a similarity (an empty mask).

    Raises:
        ValueError: no training volume.
    """
    if measure not in MEASURES:
        raise ValueError(f"nearest_similarity: measure {measure!r} is not one of {MEASURES}")
    best = torch.full((queries.shape[0],), -torch.inf, dtype=torch.float64)
    index = torch.full((queries.shape[0],), -1, dtype=torch.int64)
    q, seen = _flat(queries, measure), 0  # the queries' rows once, for every chunk
    for chunk in training:
        if tuple(chunk.shape[1:]) != tuple(queries.shape[1:]):
            raise ValueError(f"nearest_similarity: training volumes {tuple(chunk.shape[1:])} against "
                             f"{tuple(queries.shape[1:])}")
        s = _flat_similarity(q, _flat(chunk, measure), measure)  # (Q, m)
        value, at = s.max(1)
        better = value > best
        best, index = torch.where(better, value, best), torch.where(better, at + seen, index)
        seen += chunk.shape[0]
    if not seen:
        raise ValueError("nearest_similarity: the training split holds no volume")
    return torch.where(index >= 0, best, torch.nan), index, seen
