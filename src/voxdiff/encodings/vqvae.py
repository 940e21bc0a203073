"""VQ-VAE latents: the lossy, learned encoding of latent diffusion (exp9_*).

The shapes and channel counts are known from the config alone (``factor``, ``latent_channels``), so preflight and
the model factory treat this encoding like the others before any weights exist. Encoding or decoding tensors needs
a trained stage-1 checkpoint (``encoding.checkpoint``).
"""

from __future__ import annotations

import torch

from voxdiff.encodings.base import Encoding
from voxdiff.errors import ConfigError


class VQVAELatent(Encoding):
    """Latents of a 3D VQ-VAE: ``(B, C, D, H, W)`` → ``(B, C·latent_channels, D/f, H/f, W/f)``.

    Each modality (image, mask) is encoded on its own into ``latent_channels`` channels, so bravo mode sees
    ``2·latent_channels`` channels in and predicts ``latent_channels``.

    Args:
        factor: spatial compression per axis (4 or 8 in the exp9 experiments).
        latent_channels: latent channels per encoded volume channel.
        checkpoint: path to a trained stage-1 checkpoint; needed only to encode or decode tensors.
    """

    lossless = False
    has_weights = True

    def __init__(self, factor: int = 4, latent_channels: int = 4, checkpoint: str | None = None) -> None:
        super().__init__()
        for key, value in (("encoding.factor", factor), ("encoding.latent_channels", latent_channels)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(key, value, "must be a positive integer", f"set {key} to e.g. 4")
        if factor & (factor - 1):
            raise ConfigError("encoding.factor", factor, "a VQ-VAE down-samples by powers of two",
                              "use encoding.factor=4 or 8")
        self.factor = factor
        self.latent_channels = latent_channels
        self.checkpoint = checkpoint
        self.autoencoder: torch.nn.Module | None = None

    def encoded_channels(self, in_channels: int) -> int:
        return in_channels * self.latent_channels

    def _require_weights(self) -> torch.nn.Module:
        if self.autoencoder is None:
            raise RuntimeError(
                f"the vqvae encoding (factor {self.factor}) has no trained weights loaded "
                f"(encoding.checkpoint={self.checkpoint}); train stage 1 first and point encoding.checkpoint at it"
            )
        return self.autoencoder

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        ae = self._require_weights()
        # each channel (modality) is encoded separately: (B, C, ...) -> (B, C*latent_channels, ...)
        return torch.cat([ae.encode_stage_2_inputs(x[:, i : i + 1]) for i in range(x.shape[1])], dim=1)

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        ae = self._require_weights()
        k = self.latent_channels
        return torch.cat([ae.decode_stage_2_outputs(z[:, i : i + k]) for i in range(0, z.shape[1], k)], dim=1)

    def extra_repr(self) -> str:
        return f"factor={self.factor}, latent_channels={self.latent_channels}, checkpoint={self.checkpoint}"
