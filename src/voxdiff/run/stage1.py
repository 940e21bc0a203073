"""How a VQ-VAE stage 1 trains, validated: the stage-1 part of a run spec (:attr:`voxdiff.run.spec.SystemSpec.stage1`).

:func:`stage1_settings` checks ``system.vqvae``, ``.optim``, ``.loss``, ``.modalities``, ``.volume_shape`` and
``.codebook``; the architecture's own arguments are :func:`voxdiff.encodings.vqvae.vqvae_spec`'s.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from voxdiff.encodings.vqvae import VQVAESpec, as_list, vqvae_spec
from voxdiff.errors import ConfigError, Problems, boolean, number
from voxdiff.step.optim import OptimSettings, optim_settings

__all__ = ["MODALITIES", "RECONSTRUCTION_LOSSES", "Stage1Settings", "stage1_settings"]


#: batch keys a stage 1 trains on (``system.modalities``), and its reconstruction losses (``system.loss``)
MODALITIES = ("image", "mask")
RECONSTRUCTION_LOSSES = ("mse", "l1")


@dataclass(frozen=True)
class Stage1Settings:
    """How stage 1 trains (``configs/system/vqvae.yaml``), validated: what
    :class:`voxdiff.lightning.vqvae.VQVAESystem` is built from and saves as plain hyper-parameters.

    Attributes:
        vqvae: the architecture.
        optim: AdamW and its schedule (:class:`voxdiff.step.OptimSettings`).
        loss: ``{"reconstruction": "mse" | "l1", "quantization_weight": float}``.
        modalities: batch keys stacked into the autoencoder's batch.
        volume_shape: ``(D, H, W)`` of the training volumes (each divisible by the factor), or None.
        codebook: ``{"init_from_data": bool, "dead_code_fraction": float in [0, 1)}``.
    """

    vqvae: VQVAESpec
    optim: OptimSettings
    loss: dict[str, Any]
    modalities: tuple[str, ...]
    volume_shape: tuple[int, int, int] | None
    codebook: dict[str, Any]


def stage1_settings(
    vqvae: Mapping[str, Any],
    optim: Mapping[str, Any] | None = None,
    loss: Mapping[str, Any] | None = None,
    modalities: Sequence[str] = MODALITIES,
    volume_shape: Sequence[int] | None = None,
    codebook: Mapping[str, Any] | None = None,
) -> Stage1Settings:
    """Validate ``system.vqvae``, ``.optim``, ``.loss``, ``.modalities``, ``.volume_shape`` and ``.codebook`` of a
    stage-1 run (plain values; missing keys of ``loss`` and ``codebook`` take their defaults).

    Raises:
        ConfigError: the one problem, or :class:`~voxdiff.errors.ConfigErrors` naming every problem found.
    """
    collect = Problems()
    spec = collect(lambda: vqvae_spec(**dict(vqvae or {})))
    optim_ = collect(lambda: optim_settings(optim or {}))
    loss = {"reconstruction": "mse", "quantization_weight": 1.0, **dict(loss or {})}
    codebook = {"init_from_data": True, "dead_code_fraction": 0.03, **dict(codebook or {})}
    modalities = tuple(as_list(modalities) or ())
    if loss["reconstruction"] not in RECONSTRUCTION_LOSSES:
        collect.found.append(ConfigError("system.loss.reconstruction", loss["reconstruction"],
                                         "unknown reconstruction loss",
                                         f"use one of {', '.join(RECONSTRUCTION_LOSSES)}"))
    collect(lambda: number("system.loss.quantization_weight", loss["quantization_weight"], lo=0,
                           fix="use 1.0 (the weight of the VQ loss)"))
    if not modalities or not set(modalities) <= set(MODALITIES) or len(set(modalities)) != len(modalities):
        collect.found.append(ConfigError("system.modalities", list(modalities),
                                         f"must be distinct batch keys out of {MODALITIES}",
                                         "use [image, mask] (one shared VQ-VAE for both)"))
    collect(lambda: boolean("system.codebook.init_from_data", codebook["init_from_data"], fix="use true"))
    collect(lambda: number("system.codebook.dead_code_fraction", codebook["dead_code_fraction"], lo=0, hi=1,
                           hi_open=True, fix="use 0.03 (or 0 to turn dead-code restarts off)"))
    shape = None
    if volume_shape is not None:
        shape = tuple(int(v) for v in as_list(volume_shape))
        for axis, size in zip(("depth", "height", "width"), shape):
            if spec is not None and size % spec.factor:
                collect.found.append(ConfigError(
                    "data.volume_shape", list(shape), f"the {axis} {size} is not divisible by the VQ-VAE factor "
                    f"{spec.factor}", f"pad or crop the {axis} to a multiple of {spec.factor}"))
                break
    collect.raise_all()
    return Stage1Settings(vqvae=spec, optim=optim_, loss=loss, modalities=modalities, volume_shape=shape,
                          codebook=codebook)
