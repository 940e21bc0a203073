"""The optimizer and the learning-rate schedule of the diffusion system (shared with the preflight).

``build_optimizer`` is the one place an optimizer is made from ``system.optim``: the Lightning system calls it
in ``configure_optimizers`` and the preflight calls it to trace the same optimizer step (its state is 2 fp32
tensors per parameter: ``exp_avg`` and ``exp_avg_sq``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch

from voxdiff.errors import ConfigError


@dataclass(frozen=True)
class OptimSettings:
    """The validated ``system.optim`` config."""

    lr: float = 1.0e-4  # peak learning rate (after warm-up)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1.0e-8
    weight_decay: float = 0.0  # decoupled (AdamW); applied to weights with ndim >= 2 only
    foreach: bool | None = None  # None: torch's default
    fused: bool | None = None  # None: torch's default (fused=True needs all parameters on a GPU)
    warmup_steps: int = 0  # linear warm-up from 0 to lr over this many optimizer steps
    decay_steps: int | None = None  # cosine decay ends here (None: at the end of the run)
    min_lr_ratio: float = 0.1  # the cosine decays to lr * min_lr_ratio, then stays there

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["betas"] = list(self.betas)
        return d


def _bad(key: str, value: Any, problem: str, fix: str) -> ConfigError:
    return ConfigError(f"system.optim.{key}", value, problem, fix)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def optim_settings(cfg: Mapping[str, Any] | None = None) -> OptimSettings:
    """Validate a plain ``system.optim`` mapping.

    Raises:
        ConfigError: naming ``system.optim.<key>``, the value and a fix.
    """
    values = dict(cfg or {})
    known = set(OptimSettings.__dataclass_fields__)
    unknown = sorted(set(values) - known)
    if unknown:
        raise _bad(unknown[0], values[unknown[0]], "is not an optimizer setting",
                   f"remove it; the settings are {', '.join(sorted(known))}")
    if "betas" in values and values["betas"] is not None:
        values["betas"] = tuple(values["betas"])
    s = OptimSettings(**values)
    if not _is_number(s.lr) or s.lr <= 0:
        raise _bad("lr", s.lr, "must be a positive number", "e.g. system.optim.lr=1e-4")
    if len(s.betas) != 2 or not all(_is_number(b) and 0 <= b < 1 for b in s.betas):
        raise _bad("betas", list(s.betas), "must be two numbers in [0, 1)", "e.g. system.optim.betas=[0.9,0.999]")
    if not _is_number(s.eps) or s.eps <= 0:
        raise _bad("eps", s.eps, "must be a positive number", "e.g. system.optim.eps=1e-8")
    if not _is_number(s.weight_decay) or s.weight_decay < 0:
        raise _bad("weight_decay", s.weight_decay, "must be a number >= 0", "e.g. system.optim.weight_decay=0.0")
    for key in ("foreach", "fused"):
        if getattr(s, key) not in (None, True, False):
            raise _bad(key, getattr(s, key), "must be true, false or null", f"use system.optim.{key}=null")
    if s.foreach and s.fused:
        raise _bad("fused", s.fused, "cannot be combined with system.optim.foreach=true",
                   "set one of them to null")
    if isinstance(s.warmup_steps, bool) or not isinstance(s.warmup_steps, int) or s.warmup_steps < 0:
        raise _bad("warmup_steps", s.warmup_steps, "must be an integer >= 0", "e.g. system.optim.warmup_steps=500")
    if s.decay_steps is not None and (
        isinstance(s.decay_steps, bool) or not isinstance(s.decay_steps, int) or s.decay_steps < 1
    ):
        raise _bad("decay_steps", s.decay_steps, "must be a positive integer or null",
                   "use null to decay over the whole run")
    if not _is_number(s.min_lr_ratio) or not 0 <= s.min_lr_ratio <= 1:
        raise _bad("min_lr_ratio", s.min_lr_ratio, "must be a number in [0, 1]", "e.g. system.optim.min_lr_ratio=0.1")
    return s


def build_optimizer(
    params: Iterable[torch.nn.Parameter], optim_cfg: OptimSettings | Mapping[str, Any]
) -> torch.optim.AdamW:
    """AdamW over ``params`` with the settings of ``system.optim``: the optimizer of the diffusion system.

    Weights with two or more dimensions (convolutions, linear layers) get ``weight_decay``; biases and norm scales
    get none (nanoGPT's split). The learning rate is the peak ``lr``; :class:`WarmupCosine` scales it per step.

    Args:
        params: the parameters to optimise (those with ``requires_grad``; frozen ones are skipped).
        optim_cfg: :class:`OptimSettings` or a plain ``system.optim`` mapping (validated here).

    Returns:
        ``torch.optim.AdamW``: one parameter group without weight decay, else two (``decay``, ``no_decay``).
    """
    s = optim_cfg if isinstance(optim_cfg, OptimSettings) else optim_settings(optim_cfg)
    params = [p for p in params if p.requires_grad]
    if not params:
        raise ValueError("build_optimizer: no trainable parameters")
    if s.weight_decay == 0:
        groups: list[dict[str, Any]] = [{"params": params, "weight_decay": 0.0}]
    else:
        groups = [g for g in (
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": s.weight_decay, "name": "decay"},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0, "name": "no_decay"},
        ) if g["params"]]
    return torch.optim.AdamW(groups, lr=s.lr, betas=s.betas, eps=s.eps, foreach=s.foreach, fused=s.fused)


class WarmupCosine:
    """Learning-rate multiplier per optimizer step: linear warm-up, then cosine decay to ``min_lr_ratio``.

    ``factor(step)`` is ``(step + 1) / warmup_steps`` during warm-up, then
    ``min_lr_ratio + (1 - min_lr_ratio) · ½(1 + cos(π · progress))`` with ``progress`` going from 0 at the end of
    warm-up to 1 at ``decay_steps``, then ``min_lr_ratio``. A callable object (not a lambda), so
    ``LambdaLR.state_dict()`` saves it and a resumed run continues the same curve.
    """

    def __init__(self, warmup_steps: int, decay_steps: int, min_lr_ratio: float) -> None:
        self.warmup_steps = int(warmup_steps)
        self.decay_steps = max(int(decay_steps), self.warmup_steps + 1)
        self.min_lr_ratio = float(min_lr_ratio)

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        progress = min(1.0, (step - self.warmup_steps) / (self.decay_steps - self.warmup_steps))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_lr_scheduler(optimizer: torch.optim.Optimizer, settings: OptimSettings,
                       total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """``LambdaLR`` with :class:`WarmupCosine`; ``total_steps`` is used when ``settings.decay_steps`` is None."""
    decay_steps = settings.decay_steps if settings.decay_steps is not None else max(1, int(total_steps))
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, WarmupCosine(settings.warmup_steps, decay_steps, settings.min_lr_ratio)
    )


def configure_adamw(params: Iterable[torch.nn.Parameter], settings: OptimSettings,
                    estimated_stepping_batches: float) -> dict[str, Any]:
    """What a system's ``configure_optimizers`` returns: AdamW and the per-step warm-up/cosine schedule.

    Args:
        params: the parameters to optimise.
        settings: ``system.optim``.
        estimated_stepping_batches: ``trainer.estimated_stepping_batches`` (the run length; inf when unbounded).

    Raises:
        ConfigError: an unbounded run without ``system.optim.decay_steps`` (the cosine would have no end).
    """
    optimizer = build_optimizer(params, settings)
    total = estimated_stepping_batches
    if settings.decay_steps is None and not math.isfinite(total):
        raise ConfigError("system.optim.decay_steps", None,
                          "the run has no fixed length (trainer.max_steps=-1 and trainer.max_epochs=-1), so "
                          "the cosine decay has no end", "set system.optim.decay_steps or trainer.max_steps")
    scheduler = build_lr_scheduler(optimizer, settings, int(total) if math.isfinite(total) else 1)
    return {"optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1, "name": "lr"}}
