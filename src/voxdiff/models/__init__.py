"""The denoiser: MONAI's 3D ``DiffusionModelUNet``, built from a config, with a gradient-checkpointing policy."""

from voxdiff.models.checkpointing import (
    GRANULARITIES,
    apply_gradient_checkpointing,
    checkpointed_modules,
    remove_gradient_checkpointing,
)
from voxdiff.models.unet import (
    MODES,
    ROW_COLUMNS,
    UNetSpec,
    build_unet,
    build_unet_from_spec,
    count_parameters,
    unet_io_channels,
    unet_spec,
)

__all__ = [
    "GRANULARITIES",
    "MODES",
    "ROW_COLUMNS",
    "UNetSpec",
    "apply_gradient_checkpointing",
    "build_unet",
    "build_unet_from_spec",
    "checkpointed_modules",
    "count_parameters",
    "remove_gradient_checkpointing",
    "unet_io_channels",
    "unet_spec",
]
