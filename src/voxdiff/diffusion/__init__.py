"""The diffusion process, apart from the denoiser and from Lightning (STYLE.md, habit 8).

* :class:`DiffusionProcess`: DDPM noising, targets (epsilon / v / x0), min-SNR-γ weights, the loss of one batch
  (:meth:`DiffusionProcess.loss`, shared with the preflight) and DDIM sampling.
* :class:`RectifiedFlow` (``diffusion=rflow``): MONAI's rectified flow, velocity loss, Euler sampling.
* :func:`diffusion_settings` / :func:`build_process`: the process a ``diffusion:`` config names.
* :mod:`voxdiff.diffusion.guidance`: classifier-free guidance (condition dropout, guided predictions).
* :func:`encode_batch` / :func:`decode_volume`: data batch ↔ encodings in model range, for both modes.
"""

from voxdiff.diffusion.batch import (
    MODES,
    decode_volume,
    encode_batch,
    encode_volume,
    encoded_range,
    to_model_range,
)
from voxdiff.diffusion.guidance import GuidanceSettings, guidance_settings
from voxdiff.diffusion.process import (
    PREDICTION_TYPES,
    SCHEDULES,
    DiffusionProcess,
    DiffusionSettings,
    min_snr_weight,
)
from voxdiff.diffusion.processes import PROCESSES, Process, build_process, diffusion_settings
from voxdiff.diffusion.rflow import RectifiedFlow, RFlowSettings

__all__ = [
    "MODES",
    "PREDICTION_TYPES",
    "PROCESSES",
    "Process",
    "SCHEDULES",
    "DiffusionProcess",
    "DiffusionSettings",
    "GuidanceSettings",
    "RFlowSettings",
    "RectifiedFlow",
    "build_process",
    "decode_volume",
    "diffusion_settings",
    "encode_batch",
    "encode_volume",
    "encoded_range",
    "guidance_settings",
    "min_snr_weight",
    "to_model_range",
]
