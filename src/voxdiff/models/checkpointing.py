"""Gradient checkpointing for MONAI's ``DiffusionModelUNet`` as a policy applied to a built model.

MONAI's diffusion UNet has no checkpointing of its own, and a flag that changes nothing is the worst outcome, so
this module wraps the forward of the chosen sub-modules in :func:`torch.utils.checkpoint.checkpoint`
(``use_reentrant=False``): their activations are dropped after forward and recomputed in backward; only the
segment inputs stay. The policy is active only while gradients are enabled (inference is unchanged) and keeps
the state-dict keys, so checkpoints load with or without it.

Granularities:

* ``none``  — nothing is checkpointed.
* ``block`` — each down block, the middle block and each up block is one segment.
* ``layer`` — each resnet block and each attention block is one segment (finer: lower peak, same recompute).
"""

from __future__ import annotations

import types
from typing import Any

import torch
from monai.networks.blocks.spatialattention import SpatialAttentionBlock
from monai.networks.nets.diffusion_model_unet import (
    DiffusionModelUNet,
    DiffusionUNetResnetBlock,
    SpatialTransformer,
)
from torch import nn
from torch.utils.checkpoint import checkpoint

from voxdiff.errors import ConfigError

GRANULARITIES = ("none", "block", "layer")
_FLAG = "_voxdiff_checkpointed"


def _checkpointed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    forward = type(self).forward
    if torch.is_grad_enabled():
        return checkpoint(
            forward, self, *args, use_reentrant=False, preserve_rng_state=getattr(self, _FLAG), **kwargs
        )
    return forward(self, *args, **kwargs)


def _segments(model: DiffusionModelUNet, granularity: str) -> list[nn.Module]:
    if granularity == "block":
        return [*model.down_blocks, model.middle_block, *model.up_blocks]
    if granularity == "layer":
        layer_types = (DiffusionUNetResnetBlock, SpatialAttentionBlock, SpatialTransformer)
        return [m for m in model.modules() if isinstance(m, layer_types)]
    return []


def apply_gradient_checkpointing(
    model: nn.Module, granularity: str = "layer", preserve_rng_state: bool = True
) -> list[str]:
    """Checkpoint the sub-modules of ``model`` that ``granularity`` selects; returns their names.

    Args:
        model: a built ``DiffusionModelUNet``.
        granularity: ``none``, ``block`` or ``layer`` (see the module docstring).
        preserve_rng_state: restore the RNG state when recomputing (needed for dropout; the preflight's trace
            turns it off because it touches the CUDA RNG).

    Raises:
        ConfigError: an unknown granularity, or a model this policy does not know (it would silently do nothing).
    """
    if granularity not in GRANULARITIES:
        raise ConfigError(
            "model.gradient_checkpointing", granularity, "unknown checkpointing granularity",
            f"use one of {', '.join(GRANULARITIES)}",
        )
    remove_gradient_checkpointing(model)
    if granularity == "none":
        return []
    if not isinstance(model, DiffusionModelUNet):
        raise ConfigError(
            "model.gradient_checkpointing", granularity,
            f"the checkpointing policy supports MONAI's DiffusionModelUNet, not {type(model).__name__}",
            "set model.gradient_checkpointing=none",
        )
    segments = set(map(id, _segments(model, granularity)))
    names = []
    for name, module in model.named_modules():
        if id(module) in segments:
            setattr(module, _FLAG, preserve_rng_state)
            module.forward = types.MethodType(_checkpointed_forward, module)
            names.append(name)
    return names


def remove_gradient_checkpointing(model: nn.Module) -> None:
    """Undo :func:`apply_gradient_checkpointing`."""
    for module in model.modules():
        if hasattr(module, _FLAG):
            delattr(module, _FLAG)
            module.__dict__.pop("forward", None)


def checkpointed_modules(model: nn.Module) -> list[str]:
    """Names of the sub-modules that are checkpointed now."""
    return [name for name, module in model.named_modules() if hasattr(module, _FLAG)]
