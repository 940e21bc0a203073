"""One-level orthonormal 3D Haar wavelet transform (as in WDM, Friedrich et al. 2024)."""

from __future__ import annotations

import math

import torch
from einops import rearrange

from voxdiff.encodings.base import Encoding

#: sub-band names in channel order, one letter per axis (D, H, W): ``a`` low-pass, ``d`` high-pass.
SUBBANDS = ("aaa", "aad", "ada", "add", "daa", "dad", "dda", "ddd")


def _butterfly(y: torch.Tensor, dim: int) -> torch.Tensor:
    """Orthonormal 2-point Haar along ``dim`` (size 2): (x0, x1) → ((x0+x1)/√2, (x0−x1)/√2). Its own inverse."""
    x0, x1 = y.unbind(dim)
    s = 1.0 / math.sqrt(2.0)
    return torch.stack(((x0 + x1) * s, (x0 - x1) * s), dim=dim)


class HaarWavelet(Encoding):
    """One-level orthonormal 3D Haar transform: 8 sub-bands per channel at half resolution; exact inverse.

    ``(B, C, D, H, W)`` → ``(B, 8·C, D/2, H/2, W/2)``. Channel ``8·c + b`` holds sub-band ``SUBBANDS[b]`` of input
    channel ``c`` (bit order D, H, W; ``a`` = 0 low-pass, ``d`` = 1 high-pass). The coefficients equal PyWavelets'
    ``pywt.dwtn(x, "haar", axes=(-3, -2, -1))[SUBBANDS[b]]``: low-pass ``(x0 + x1)/√2``, high-pass
    ``(x0 − x1)/√2`` along each axis. It is space-to-depth followed by a 2-point Hadamard butterfly on each block
    axis; the butterfly is orthonormal and its own inverse, so unit-variance noise stays unit-variance noise.
    """

    factor = 2
    lossless = True
    label = "the Haar encoding"

    def encoded_channels(self, in_channels: int) -> int:
        return in_channels * 8

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        y = rearrange(x, "b c (d i) (h j) (w k) -> b c i j k d h w", i=2, j=2, k=2)
        for dim in (2, 3, 4):
            y = _butterfly(y, dim)
        return rearrange(y, "b c i j k d h w -> b (c i j k) d h w")

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        y = rearrange(z, "b (c i j k) d h w -> b c i j k d h w", i=2, j=2, k=2)
        for dim in (2, 3, 4):
            y = _butterfly(y, dim)
        return rearrange(y, "b c i j k d h w -> b c (d i) (h j) (w k)")
