"""Exponential moving average of a model's weights, swapped in for validation and sampling.

Updated once per optimizer step (diffusers' ``EMAModel`` habit), kept in fp32 on the model's device, saved in
checkpoints by the system's ``on_save_checkpoint``. For sampling the averaged weights are swapped in and the raw
ones restored afterwards, bit for bit (store → copy → use → restore).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from voxdiff.errors import ConfigError


class EMA:
    """EMA of the floating-point parameters of ``model``: ``shadow ← decay · shadow + (1 − decay) · param``.

    Args:
        model: the module whose parameters are averaged (names identify them in checkpoints).
        decay: the EMA decay per optimizer step (0.9999 for long runs; about ``1 − 10/steps`` for short ones).
        start_step: for the first ``start_step`` updates the average copies the weights instead (the early
            weights are noise not worth remembering).
    """

    def __init__(self, model: nn.Module, decay: float = 0.9999, start_step: int = 0) -> None:
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 <= decay < 1.0:
            raise ConfigError("system.ema.decay", decay, "must be a number in [0, 1)", "e.g. system.ema.decay=0.9999")
        if isinstance(start_step, bool) or not isinstance(start_step, int) or start_step < 0:
            raise ConfigError("system.ema.start_step", start_step, "must be an integer >= 0",
                              "e.g. system.ema.start_step=1000")
        self.decay = float(decay)
        self.start_step = start_step
        self.num_updates = 0
        self.names = [n for n, p in model.named_parameters() if p.is_floating_point()]
        params = dict(model.named_parameters())
        self.shadow = [params[n].detach().float().clone() for n in self.names]

    def _params(self, model: nn.Module) -> list[torch.Tensor]:
        params = dict(model.named_parameters())
        return [params[n] for n in self.names]

    def to(self, device: torch.device | str) -> EMA:
        """Keep the average on ``device`` (the model's)."""
        device = torch.device(device)
        if self.shadow and self.shadow[0].device != device:
            self.shadow = [s.to(device) for s in self.shadow]
        return self

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """One EMA step from the current weights of ``model`` (call once per optimizer step)."""
        params = [p.detach().float() for p in self._params(model)]
        if not params:
            return
        self.to(params[0].device)
        self.num_updates += 1
        if self.num_updates <= self.start_step:
            torch._foreach_copy_(self.shadow, params)
        else:
            torch._foreach_lerp_(self.shadow, params, 1.0 - self.decay)

    @torch.no_grad()
    def copy_to(self, model: nn.Module) -> None:
        """Write the averaged weights into ``model``."""
        for p, s in zip(self._params(model), self.shadow):
            p.copy_(s)

    @contextmanager
    def swapped(self, model: nn.Module) -> Iterator[nn.Module]:
        """``with ema.swapped(model): ...`` runs with the averaged weights and restores the raw ones exactly."""
        params = self._params(model)
        with torch.no_grad():
            stored = [p.detach().clone() for p in params]
            self.copy_to(model)
        try:
            yield model
        finally:
            with torch.no_grad():
                for p, raw in zip(params, stored):
                    p.copy_(raw)

    def state_dict(self) -> dict[str, Any]:
        return {
            "decay": self.decay,
            "start_step": self.start_step,
            "num_updates": self.num_updates,
            "shadow": {n: s.detach().clone() for n, s in zip(self.names, self.shadow)},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the average and the update count (decay and start step stay those of the current config)."""
        shadow = state["shadow"]
        missing = [n for n in self.names if n not in shadow]
        if missing:
            raise KeyError(f"the EMA state lacks {len(missing)} parameters, e.g. {missing[0]!r}")
        device = self.shadow[0].device if self.shadow else torch.device("cpu")
        self.shadow = [shadow[n].detach().float().to(device).clone() for n in self.names]
        self.num_updates = int(state["num_updates"])
