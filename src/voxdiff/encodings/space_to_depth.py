"""Space-to-depth: a lossless rearrangement of f×f×f voxel blocks into channels."""

from __future__ import annotations

import torch
from einops import rearrange

from voxdiff.encodings.base import Encoding
from voxdiff.errors import integer


class SpaceToDepth(Encoding):
    """Fold each ``f×f×f`` block of voxels into channels: exact, weight-free, its own inverse.

    ``(B, C, D, H, W)`` → ``(B, C·f³, D/f, H/f, W/f)``. Channel order: the input channel is the slowest index,
    then the offset inside the block along D, H, W (``c·f³ + i·f² + j·f + k`` holds ``x[c, d·f+i, h·f+j, w·f+k]``),
    the same order as :class:`~voxdiff.encodings.HaarWavelet`'s sub-bands for ``f = 2``.

    Args:
        factor: block size per axis (default 2).
    """

    lossless = True
    label = "the S2D encoding"

    def __init__(self, factor: int = 2) -> None:
        super().__init__()
        integer("encoding.factor", factor, minimum=1, fix="use encoding.factor=2 (or 4)")
        self.factor = factor

    def encoded_channels(self, in_channels: int) -> int:
        return in_channels * self.factor**3

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        f = self.factor
        return rearrange(x, "b c (d i) (h j) (w k) -> b (c i j k) d h w", i=f, j=f, k=f)

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        f = self.factor
        return rearrange(z, "b (c i j k) d h w -> b c (d i) (h j) (w k)", i=f, j=f, k=f)
