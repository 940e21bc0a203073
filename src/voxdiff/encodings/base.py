"""The interface every volume encoding implements.

An encoding turns a volume ``(B, C, D, H, W)`` into what the UNet sees, ``(B, C * channel_multiplier, D/f, H/f,
W/f)``, and back. Space-to-depth and Haar are exact and weight-free; the VQ-VAE latent has weights and is lossy.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch
from torch import nn

from voxdiff.errors import ConfigError

AXES = ("depth", "height", "width")


class Encoding(nn.Module, ABC):
    """Base class of the encodings.

    Subclasses set :attr:`factor` (spatial down-sampling per axis), :attr:`lossless` and implement
    :meth:`encoded_channels`, :meth:`encode` and :meth:`decode`. An encoding is an ``nn.Module`` so that one
    with weights (VQ-VAE) moves to the GPU with the system; weight-free ones have no parameters.
    """

    #: spatial down-sampling factor per axis (D, H, W each divided by it)
    factor: int = 1
    #: whether ``decode(encode(x)) == x`` (up to float rounding)
    lossless: bool = True
    #: whether the encoding has learned weights that must be loaded before use
    has_weights: bool = False

    @property
    def label(self) -> str:
        """How an error message names what the UNet sees ("the S2D encoding", "the 8× latent")."""
        return f"the {type(self).__name__} encoding"

    @abstractmethod
    def encoded_channels(self, in_channels: int) -> int:
        """Channel count of the encoding of a volume with ``in_channels`` channels."""

    @abstractmethod
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, C, D, H, W)`` volume → ``(B, encoded_channels(C), D/f, H/f, W/f)``."""

    @abstractmethod
    def decode(self, z: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`encode`: ``(B, encoded_channels(C), d, h, w)`` → ``(B, C, d·f, h·f, w·f)``."""

    def decoded_channels(self, encoded_channels: int) -> int:
        """Channel count of the volume that an encoding with ``encoded_channels`` channels decodes to."""
        per_channel = self.encoded_channels(1)
        if encoded_channels % per_channel:
            raise ValueError(
                f"{type(self).__name__} encodes each volume channel into {per_channel} channels; "
                f"{encoded_channels} encoded channels is not a multiple of that"
            )
        return encoded_channels // per_channel

    def check_volume_shape(self, spatial: Sequence[int], key: str = "data.volume_shape") -> None:
        """Refuse a volume whose size is not divisible by the factor, naming the axis, the size and the factor."""
        spatial = tuple(int(s) for s in spatial)
        if len(spatial) != 3:
            raise ConfigError(key, list(spatial), "a volume shape is three sizes (D, H, W)", "give D, H and W")
        for axis, size in zip(AXES, spatial):
            if size <= 0 or size % self.factor:
                lower = (size // self.factor) * self.factor
                upper = lower + self.factor
                raise ConfigError(
                    key,
                    list(spatial),
                    f"the {axis} {size} is not divisible by the {type(self).__name__} factor {self.factor}",
                    f"pad or crop the {axis} to a multiple of {self.factor} (e.g. {upper}"
                    + (f" or {lower})" if lower > 0 else ")"),
                )

    def encoded_shape(self, shape: Sequence[int]) -> tuple[int, int, int, int]:
        """``(C, D, H, W)`` of a volume → ``(C', D/f, H/f, W/f)`` of its encoding (checks divisibility)."""
        c, *spatial = (int(s) for s in shape)
        self.check_volume_shape(spatial)
        d, h, w = (s // self.factor for s in spatial)
        return (self.encoded_channels(c), d, h, w)

    def _check_input(self, x: torch.Tensor) -> None:
        if x.dim() != 5:
            raise ValueError(f"{type(self).__name__}.encode expects (B, C, D, H, W), got shape {tuple(x.shape)}")
        self.check_volume_shape(x.shape[2:], key="input")

    def extra_repr(self) -> str:
        return f"factor={self.factor}, lossless={self.lossless}"
