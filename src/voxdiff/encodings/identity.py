"""Pixel space: the UNet sees the volume as it is."""

from __future__ import annotations

import torch

from voxdiff.encodings.base import Encoding


class Identity(Encoding):
    """No encoding: ``(B, C, D, H, W)`` → the same tensor."""

    factor = 1
    lossless = True
    label = "the volume"

    def encoded_channels(self, in_channels: int) -> int:
        return in_channels

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        return x

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        return z
