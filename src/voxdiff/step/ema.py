"""Exponential moving average of a model's weights, swapped in for validation and sampling.

Called once per optimizer step by the training step's post-step hook (it averages every k-th call, below), kept in
fp32 on the model's device (one more parameter-sized copy on the GPU, which the preflight traces), saved in
checkpoints by the system's ``on_save_checkpoint``. For validation and sampling the averaged weights and the raw
ones trade places, one tensor at a time, and trade back afterwards, bit for bit: no second copy of the model.

``system.ema`` configures it: a mapping of :class:`EMASettings` (null or absent: the defaults) or ``false``
for no EMA at all — in training, in the preflight's trace and in the measure mode alike (:func:`ema_settings`).

How often it averages (``system.ema.every_n_steps``, ``auto`` by default: :func:`auto_interval`): every k-th
optimizer step with the decay raised to the k-th power keeps the horizon ``1 / (1 - decay)`` in optimizer steps
and makes k times fewer passes over the weights (12 bytes per parameter each: 32 GB, about 11 ms on an H100, for
a 2.7B-parameter UNet). ``auto`` takes the largest k up to :data:`MAX_AUTO_INTERVAL` that still samples the weights
:data:`SAMPLES_PER_HORIZON` times per horizon: 10 for the default decay 0.9999 (ema-pytorch's ``update_every=10``
beside ``beta=0.9999``, which does not raise the decay), 1 for the demos' short horizons (decay 0.95 and 0.99).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from voxdiff.errors import ConfigError, integer, number, settings_from

MAX_AUTO_INTERVAL = 10
"""The longest interval ``every_n_steps: auto`` takes (a tenth of the passes: the EMA's cost is small by then)."""
SAMPLES_PER_HORIZON = 100
"""The fewest updates per horizon ``1 / (1 - decay)`` that ``every_n_steps: auto`` keeps: averaging every k-th step
moves the mean age of the averaged weights by at most ``(k - 1) / 2`` steps either way (younger just after an
update, older just before the next), under 0.5% of such a horizon."""


def auto_interval(decay: float) -> int:
    """``every_n_steps: auto`` for ``decay``: the largest k ≤ :data:`MAX_AUTO_INTERVAL` with at least
    :data:`SAMPLES_PER_HORIZON` updates per horizon ``1 / (1 - decay)`` (0.9999 → 10, 0.999 → 10, 0.995 → 2,
    0.99 → 1)."""
    horizon = 1.0 / (1.0 - decay)
    return max(1, min(MAX_AUTO_INTERVAL, int(round(horizon / SAMPLES_PER_HORIZON, 6))))


@dataclass(frozen=True)
class EMASettings:
    """``system.ema``: decay per optimizer step, the number of steps that copy instead of averaging, and how
    often the average is updated (``every_n_steps``: one foreach update every k steps with the decay raised to the
    k-th power, so that the averaging horizon stays ``1 / (1 - decay)`` optimizer steps; ``"auto"``:
    :func:`auto_interval` of the decay, resolved to that number on construction)."""

    decay: float = 0.9999
    start_step: int = 0
    every_n_steps: int | str = "auto"

    def __post_init__(self) -> None:
        d = self.decay
        if self.every_n_steps == "auto" and isinstance(d, (int, float)) and not isinstance(d, bool) and 0 <= d < 1:
            object.__setattr__(self, "every_n_steps", auto_interval(d))  # a bad decay: ema_settings names it


def ema_settings(cfg: Mapping[str, Any] | bool | None) -> EMASettings | None:
    """Validate ``system.ema``: ``false`` → None (no EMA); null, ``true`` or absent → the defaults; a mapping →
    its settings (``every_n_steps: auto`` resolved to a number: :func:`auto_interval`).

    Raises:
        ConfigError: naming the key, the value and a fix.
    """
    if cfg is False:
        return None
    if cfg is None or cfg is True:
        cfg = {}
    if not isinstance(cfg, Mapping):
        raise ConfigError("system.ema", cfg, "must be a mapping of EMA settings or false",
                          "e.g. system.ema.decay=0.9999, or system.ema=false for no EMA")
    e = settings_from(EMASettings, "system.ema", cfg)
    number("system.ema.decay", e.decay, lo=0, hi=1, hi_open=True, example=0.9999)
    integer("system.ema.start_step", e.start_step, minimum=0, example="1000")
    k = e.every_n_steps
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ConfigError("system.ema.every_n_steps", k, "must be a positive integer or auto",
                          "e.g. system.ema.every_n_steps=4, or auto (10 for decay 0.9999, 1 for 0.99)")
    return e


class EMA:
    """EMA of the floating-point parameters of ``model``: ``shadow ← decay · shadow + (1 − decay) · param``.

    Args:
        model: the module whose parameters are averaged (names identify them in checkpoints).
        decay: the EMA decay per optimizer step (0.9999 for long runs; about ``1 − 10/steps`` for short ones).
        start_step: for the first ``start_step`` updates the average copies the weights instead (the early
            weights are noise not worth remembering).
        every_n_steps: average every k-th optimizer step only, with ``decay ** k``: the same horizon in
            optimizer steps, k times fewer passes over the weights. Where the weights stay the same between
            updates this equals updating every step exactly. ``"auto"``: :func:`auto_interval` of ``decay``.
    """

    def __init__(self, model: nn.Module, decay: float = 0.9999, start_step: int = 0,
                 every_n_steps: int | str = 1) -> None:
        settings = ema_settings({"decay": decay, "start_step": start_step, "every_n_steps": every_n_steps})
        assert settings is not None  # names system.ema.* on a bad value
        self.decay = float(decay)
        self.start_step = start_step
        self.every_n_steps = int(settings.every_n_steps)
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
        """Call once per optimizer step (``num_updates`` counts them); averages on every ``every_n_steps``-th."""
        self.num_updates += 1
        if self.num_updates % self.every_n_steps:
            return
        params = [p.detach().float() for p in self._params(model)]
        if not params:
            return
        self.to(params[0].device)
        shadow, params = _local(self.shadow), _local(params)  # FSDP: each rank averages its own shards
        if self.num_updates <= self.start_step:
            torch._foreach_copy_(shadow, params)
        else:
            torch._foreach_lerp_(shadow, params, 1.0 - self.decay ** self.every_n_steps)

    @torch.no_grad()
    def copy_to(self, model: nn.Module) -> None:
        """Write the averaged weights into ``model``."""
        for p, s in zip(self._params(model), self.shadow):
            p.copy_(s)

    @contextmanager
    def swapped(self, model: nn.Module) -> Iterator[nn.Module]:
        """``with ema.swapped(model): ...`` runs with the averaged weights and restores the raw ones exactly.

        The weights and the average trade places one tensor at a time (the average holds the raw weights while
        the block runs), so the swap costs one temporary of the largest parameter, not a copy of the model. A
        model whose parameters are not fp32 (cast for inference) is written the average and gets a stored copy of
        its raw weights back, so that the fp32 average never round-trips through a lower precision.
        """
        params = self._params(model)
        if params:
            self.to(params[0].device)
        pairs = list(zip(_local(params), _local(self.shadow)))  # FSDP: each rank its own shards
        if all(p.dtype == s.dtype for p, s in pairs):
            _exchange(pairs)
            try:
                yield model
            finally:
                _exchange(pairs)
            return
        with torch.no_grad():
            stored = [p.detach().clone() for p in params]
            self.copy_to(model)
        try:
            yield model
        finally:
            with torch.no_grad():
                for p, raw in zip(params, stored):
                    p.copy_(raw)

    @staticmethod
    def swap_bytes(model: nn.Module) -> int:
        """The most memory the swap holds aside: the largest floating-point parameter, in fp32 bytes."""
        return max((p.numel() * 4 for p in model.parameters() if p.is_floating_point()), default=0)

    def state_dict(self) -> dict[str, Any]:
        return {
            "decay": self.decay,
            "start_step": self.start_step,
            "num_updates": self.num_updates,
            "shadow": {n: s.detach().clone() for n, s in zip(self.names, self.shadow)},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the average and the update count (decay and start step stay those of the current config).
        Full tensors are split into shards where the average is sharded (FSDP: every rank takes its own)."""
        shadow = state["shadow"]
        missing = [n for n in self.names if n not in shadow]
        if missing:
            raise KeyError(f"the EMA state lacks {len(missing)} parameters, e.g. {missing[0]!r}")
        self.shadow = [_like(shadow[n].detach().float(), old) for n, old in zip(self.names, self.shadow)]
        self.num_updates = int(state["num_updates"])


@torch.no_grad()
def _exchange(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Exchange the values of each pair of same-dtype tensors in place, with one temporary at a time."""
    for a, b in pairs:
        tmp = a.detach().clone()
        a.copy_(b)
        b.copy_(tmp)
        del tmp


def _local(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The local shards of DTensors (views: in-place ops on them update the DTensor), other tensors as they are."""
    from torch.distributed.tensor import DTensor

    return [t.to_local() if isinstance(t, DTensor) else t for t in tensors]


def _like(full: torch.Tensor, current: torch.Tensor) -> torch.Tensor:
    """``full`` laid out as ``current``: on its device, in its memory layout (a checkpoint of a channels-last run
    loads into a contiguous one and back), and split as it is if it is a DTensor (each rank keeps its own shard of
    its own copy of ``full``; no communication)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(current, DTensor):
        return distribute_tensor(full.to(current.device), current.device_mesh, current.placements,
                                 src_data_rank=None)
    return torch.empty_like(current, dtype=full.dtype).copy_(full)
