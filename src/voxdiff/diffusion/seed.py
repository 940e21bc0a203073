"""The loss of the seed project's reference loop: the step that ``reference/h100_measured.csv`` measured.

A plain epsilon-prediction DDPM loss with a linear ``alpha_bar`` from 0.9999 to 1e-4 and ``F.mse_loss`` of the
fp32 prediction against the noise. It is not voxdiff's training loss (:meth:`DiffusionProcess.loss`, with its
scheduler, targets and min-SNR weights): it is kept, unchanged, so that the ``seed`` recipe of
:mod:`voxdiff.step.recipe` traces the step the reference measured, tensor for tensor.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

SEED_TIMESTEPS = 1000


def seed_loss(
    model: Callable[..., torch.Tensor], x0: torch.Tensor, cond: torch.Tensor | None = None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The reference loop's loss of one batch, with the signature of :meth:`DiffusionProcess.loss`.

    Args:
        model: the denoiser, called as ``model(x_t ⊕ cond, t)``.
        x0: ``(B, C_out, *spatial)`` the clean target.
        cond: ``(B, C_cond, *spatial)`` concatenated to the noisy ``x0`` along channels, or None.

    Returns:
        ``(loss, {})``: ``mse(pred.float(), noise.float())``, an fp32 scalar.
    """
    b = x0.shape[0]
    t = torch.randint(0, SEED_TIMESTEPS, (b,), device=x0.device)
    noise = torch.randn_like(x0)
    alphas_cumprod = torch.linspace(0.9999, 1e-4, SEED_TIMESTEPS, device=x0.device)
    a = alphas_cumprod[t].view(b, *([1] * (x0.dim() - 1)))
    x_t = a.sqrt() * x0 + (1.0 - a).sqrt() * noise
    model_in = torch.cat([x_t, cond], dim=1) if cond is not None else x_t
    pred = model(model_in, t)
    return F.mse_loss(pred.float(), noise.float()), {}
