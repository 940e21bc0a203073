"""The diffusion process, apart from the denoiser and from Lightning (STYLE.md, habit 8).

* :class:`DiffusionProcess`: DDPM noising, targets (epsilon / v / x0), min-SNR-γ weights, the loss of one batch
  (:meth:`DiffusionProcess.loss`, shared with the preflight) and DDIM sampling.
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
from voxdiff.diffusion.process import (
    PREDICTION_TYPES,
    SCHEDULES,
    DiffusionProcess,
    DiffusionSettings,
    diffusion_settings,
    min_snr_weight,
)

__all__ = [
    "MODES",
    "PREDICTION_TYPES",
    "SCHEDULES",
    "DiffusionProcess",
    "DiffusionSettings",
    "decode_volume",
    "diffusion_settings",
    "encode_batch",
    "encode_volume",
    "encoded_range",
    "min_snr_weight",
    "to_model_range",
]
