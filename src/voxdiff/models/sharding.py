"""FSDP's sharding of MONAI's diffusion UNet, the policy ``trainer=fsdp`` applies (no Lightning in it: the
preflight traces the same function on meta tensors).

:func:`shard_unet` calls FSDP2's ``fully_shard`` on every resnet block and attention block (the units gathered one
at a time for their forward and backward), then on the UNet (the root unit: the convolutions in and out, the time
embedding, the up/down samplers). Each parameter becomes a ``DTensor`` split over the ranks by dim-0 rows.
"""

from __future__ import annotations

from typing import Any

import torch


def fsdp_unit_types() -> tuple[type[torch.nn.Module], ...]:
    """The MONAI blocks that become FSDP units (all-gathered one at a time); the UNet itself is the root unit."""
    from monai.networks.blocks.spatialattention import SpatialAttentionBlock
    from monai.networks.nets.diffusion_model_unet import DiffusionUNetResnetBlock

    return (DiffusionUNetResnetBlock, SpatialAttentionBlock)


def is_sharded(module: torch.nn.Module) -> bool:
    """Whether ``module``'s parameters are DTensors (sharded by :func:`shard_unet`)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in module.parameters())


def shard_unet(model: torch.nn.Module, mesh: Any, reshard_after_forward: bool = True) -> torch.nn.Module:
    """``fully_shard`` every resnet and attention block of ``model``, then ``model`` itself (in place; returns it).

    Args:
        model: a MONAI ``DiffusionModelUNet`` (any module: only its resnet/attention blocks become units).
        mesh: a 1-D ``DeviceMesh`` over the ranks that share the shards.
        reshard_after_forward: free each unit's gathered weights after its forward (and gather them again for its
            backward), FSDP's ZeRO-3; False keeps them until the backward (ZeRO-2: more memory, less traffic).
    """
    from torch.distributed.fsdp import fully_shard

    if is_sharded(model):
        return model
    units = fsdp_unit_types()
    for module in model.modules():
        if isinstance(module, units) and module is not model:
            fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    return model
