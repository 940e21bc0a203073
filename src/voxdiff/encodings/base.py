"""The interface every volume encoding implements.

An encoding turns a volume ``(B, C, D, H, W)`` into what the UNet sees, ``(B, C * channel_multiplier, D/f, H/f,
W/f)``, and back. Space-to-depth and Haar are exact and weight-free; the VQ-VAE latent has weights and is lossy.

An encoding is a plug-in: its class carries everything the rest of voxdiff asks of it — its :attr:`~Encoding.label`
in messages, its divisibility unit (:attr:`~Encoding.factor`, checked by :meth:`~Encoding.check_volume_shape`), its
channel counts (:meth:`~Encoding.encoded_channels`) and what it needs before a run (:meth:`~Encoding.check_ready`).
A new weight-free encoding is its module in ``voxdiff/encodings/`` and its ``configs/encoding/<name>.yaml`` (a
``_target_`` to the class); nothing else names it. A learned encoding implements :class:`LearnedEncoding`: the latent
cache, ``cache_latents.py``, training and sampling use only that protocol.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import Any

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

    @property
    def label(self) -> str:
        """How an error message names what the UNet sees ("the S2D encoding", "the 8× latent")."""
        return f"the {type(self).__name__} encoding"

    def check_ready(self) -> None:
        """Refuse, before anything is built, a run this encoding cannot serve (a learned encoding: weights that cannot
        be read). Weight-free encodings need nothing.

        Raises:
            ConfigError: naming the encoding's key, the value and the fix.
        """

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


class LearnedEncoding(Encoding):
    """The protocol of an encoding with learned weights (latent diffusion's stage 1).

    Its shapes and channels are known from the config alone (preflight, the model factory); encoding or decoding
    tensors needs its weights, read from a file the user names (:attr:`weights_key`, never downloaded; ``encode``
    and ``decode`` load them on first use). Diffusion on a learned encoding trains on a latent cache
    (:mod:`voxdiff.data.latents`) that the encoding wrote once: the cache records :attr:`weights_identity` and
    refuses weights with another identity. The encoding sees volumes in [0, 1] (the range stage 1 was trained on)
    and returns latents already multiplied by :attr:`latent_scale`.
    """

    lossless = False
    #: the config key that names the weights file (in error messages)
    weights_key: str = "encoding.checkpoint"

    @classmethod
    @abstractmethod
    def from_weights(cls, path: str, key: str = "encoding.checkpoint") -> LearnedEncoding:
        """An encoding configured by the weights file alone (its factor and channels read from it); ``encode`` and
        ``decode`` load the weights on first use.

        Raises:
            ConfigError: the file is missing, unreadable or not weights of this encoding (named as ``key``).
        """

    @property
    @abstractmethod
    def weights_path(self) -> str | None:
        """The weights file this encoding reads (``None``: not given yet)."""

    @abstractmethod
    def load_weights(self, path: str | None = None) -> LearnedEncoding:
        """Read the weights (``path`` or :attr:`weights_path`) and make the encoding usable; returns ``self``.

        Raises:
            ConfigError: the file is refused, or its architecture differs from this encoding's config.
        """

    @property
    @abstractmethod
    def weights_identity(self) -> str:
        """SHA-256 of the weights (not of the file): a moved or copied file keeps it, retrained weights do not.
        Reads the weights file if needed."""

    @property
    @abstractmethod
    def latent_scale(self) -> float:
        """Latents are ``latent_scale`` × the encoder's output (unit variance for the diffusion)."""

    @property
    def trained_volume_shape(self) -> tuple[int, ...] | None:
        """``(D, H, W)`` the weights were trained on, where the weights file records it (else ``None``)."""
        return None

    def weights_record(self) -> dict[str, Any]:
        """What a latent cache's index records about the weights: ``checkpoint`` (absolute path) and ``sha256``
        (:attr:`weights_identity`), plus what the encoding adds."""
        path = self.weights_path
        return {"checkpoint": str(Path(path).resolve()) if path else None, "sha256": self.weights_identity}

    def check_ready(self) -> None:
        """The weights file, when the config names one, must be readable now, not after data loading."""
        if self.weights_path is not None:
            self.weights_identity  # noqa: B018 - reads (and checks) the file
