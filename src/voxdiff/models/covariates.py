"""Covariates into MONAI's ``DiffusionModelUNet``: an embedding added to the timestep embedding.

MONAI's UNet adds ``class_embedding(class_labels)`` to its timestep embedding when ``num_class_embeds`` is set
(``DiffusionModelUNet.forward``: ``emb = time_embed(t) + class_embedding(class_labels)``, then every resnet block
gets ``emb``). That slot takes an ``nn.Embedding`` of one integer label; :func:`attach_covariates` puts a small
MLP there instead, which takes the real-valued covariate vector of :mod:`voxdiff.data.covariates` (numbers
normalised, categories one-hot, a presence entry), so the UNet is called as
``model(x, timesteps=t, class_labels=covariates)`` with ``covariates (B, K)``.

Why this and not cross-attention (``with_conditioning``/``cross_attention_dim``, MONAI's brain LDM): the embedding
reaches every resnet block of every level (cross-attention only the attention levels), costs
``K·E + E² + 2E`` parameters (``E = 4·channels[0]``; 0.27 M for ``channels[0]=128``) and no activation larger than
``(B, E)``, while cross-attention adds a key/value projection and a ``(tokens × voxels)`` score per attention
block. Measured on the CPU (``tests/models/test_covariate_embedding.py`` and the README's "Covariates").
"""

from __future__ import annotations

import torch
from torch import nn


class CovariateEmbedding(nn.Module):
    """``(B, K)`` covariates → ``(B, E)``, added to the timestep embedding: ``Linear(K, E) → SiLU → Linear(E, E)``
    (the shape of MONAI's own ``time_embed``)."""

    def __init__(self, width: int, embed_dim: int) -> None:
        super().__init__()
        if width < 1 or embed_dim < 1:
            raise ValueError(f"CovariateEmbedding needs width >= 1 and embed_dim >= 1, got {width}, {embed_dim}")
        self.width = width
        self.mlp = nn.Sequential(nn.Linear(width, embed_dim), nn.SiLU(), nn.Linear(embed_dim, embed_dim))

    def forward(self, covariates: torch.Tensor) -> torch.Tensor:
        if covariates.dim() != 2 or covariates.shape[1] != self.width:
            raise ValueError(f"covariates must be (B, {self.width}), got {tuple(covariates.shape)}")
        return self.mlp(covariates.to(self.mlp[0].weight.dtype))


def attach_covariates(unet: nn.Module, width: int) -> nn.Module:
    """Give MONAI's ``DiffusionModelUNet`` a :class:`CovariateEmbedding` of ``width`` inputs in its class-embedding
    slot; it then needs ``class_labels=(B, width)`` in every call. Returns ``unet``."""
    embed_dim = unet.time_embed[-1].out_features  # 4 * channels[0]
    unet.num_class_embeds = width  # MONAI's switch for "add class_embedding(class_labels)"
    unet.class_embedding = CovariateEmbedding(width, embed_dim)
    return unet
