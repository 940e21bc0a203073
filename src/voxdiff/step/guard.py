"""The non-finite guard of the training step, without a host synchronisation per step.

A NaN or infinite loss or gradient norm must never reach a checkpoint. Checking ``bool(torch.isfinite(loss))``
every step would make the CPU wait for the GPU every step (it could not queue the next step while the GPU
works). Instead :class:`FiniteGuard` keeps a record **on the device**: the first step whose loss or gradient norm
was not finite, what it was and its value, updated with ``torch.where`` (no sync). :meth:`FiniteGuard.check`
reads the record (one sync) and raises :class:`NonFiniteLossError` naming that step. The training step checks

* every ``system.guard.check_every_n_steps`` optimizer steps (``check_every_n_steps=1``: every step);
* always before a checkpoint is written (the Lightning system's ``on_save_checkpoint``), before validation and at
  the end of training.

So training stops at most ``check_every_n_steps - 1`` steps after the bad one, and no checkpoint is ever written
after it: the last checkpoint on disk is one from before the bad step, with finite weights.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from voxdiff.errors import ConfigError, require_nonneg_int, settings_from

#: what the record's ``what`` code stands for
WHAT = ("loss", "gradient norm")


class NonFiniteLossError(RuntimeError):
    """Training produced a NaN or infinite loss (or gradient norm).

    Attributes:
        step: the global step (optimizer steps completed before it) whose batch failed: the first bad one; None
            when it was another process's (DDP) and this one saw none.
        what: ``loss`` or ``gradient norm``.
        value: the offending value.
    """

    def __init__(self, step: int | None, what: str, value: float, detail: str = "") -> None:
        self.step, self.what, self.value = step, what, value
        where = f"at global step {step}" if step is not None else "on another process"
        super().__init__(
            f"the training {what} is {value} {where}{detail}. Training stopped, and no checkpoint was written after "
            "that step: the last one holds finite weights. Resume from the last good checkpoint (ckpt_path=...) "
            "with a lower system.optim.lr, trainer.precision=32-true or a smaller trainer.gradient_clip_val"
        )


@dataclass(frozen=True)
class GuardSettings:
    """``system.guard``: read the device-side record every ``check_every_n_steps`` optimizer steps (one host sync
    each time; 1 = every step) and always before a checkpoint is written."""

    check_every_n_steps: int = 1


def guard_settings(cfg: Mapping[str, Any] | None) -> GuardSettings:
    """Validate ``system.guard`` (null or absent: the defaults).

    Raises:
        ConfigError: naming the key, the value and a fix.
    """
    if cfg is not None and not isinstance(cfg, Mapping):
        raise ConfigError("system.guard", cfg, "must be a mapping of guard settings",
                          "e.g. system.guard.check_every_n_steps=50")
    g = settings_from(GuardSettings, "system.guard", cfg or {})
    require_nonneg_int("system.guard.check_every_n_steps", g.check_every_n_steps, "50")
    if g.check_every_n_steps == 0:
        raise ConfigError("system.guard.check_every_n_steps", 0, "must be at least 1",
                          "use 1 (every step) or e.g. 50")
    return g


class FiniteGuard:
    """The device-side record of the first non-finite loss or gradient norm (see the module docstring).

    Args:
        settings: how often :meth:`due` says a check is due.

    Attributes:
        any_rank: ``bad -> bool`` reduces a verdict over processes (DDP: one bad rank stops all); called by
            :meth:`check` on every rank at the same steps.
    """

    def __init__(self, settings: GuardSettings) -> None:
        self.settings = settings
        self.any_rank: Callable[[bool], bool] = lambda bad: bad
        self._record: torch.Tensor | None = None  # float64 (3,): first bad step + 1 (0: none), what, value

    def record(self, what: str, value: torch.Tensor, step: int) -> None:
        """Note ``value`` (a scalar: the loss or the gradient norm of global step ``step``) if it is the first
        non-finite one. Device kernels only (Python numbers go in as kernel arguments): no host synchronisation."""
        value = value.detach()
        if self._record is None or self._record.device != value.device:
            self._record = torch.zeros(3, dtype=torch.float64, device=value.device)
        first = ~torch.isfinite(value) & (self._record[0] == 0)
        new = torch.stack([torch.full_like(value, step + 1, dtype=torch.float64),
                           torch.full_like(value, WHAT.index(what), dtype=torch.float64), value.double()])
        self._record = torch.where(first, new, self._record)

    def due(self, step: int) -> bool:
        """Whether the record is to be checked after global step ``step`` (0-based) has finished."""
        return (step + 1) % self.settings.check_every_n_steps == 0

    def check(self, detail: str = "") -> None:
        """Read the record (one host sync) and raise :class:`NonFiniteLossError` for its first bad step when any
        rank has one (call it on every rank at the same point). On meta tensors (the preflight's trace) there is
        nothing to read."""
        record = self._record
        if record is not None and record.device.type == "meta":
            return
        first, what, value = record.tolist() if record is not None else (0.0, 0.0, 0.0)
        if not self.any_rank(first > 0):
            return
        if first > 0:
            raise NonFiniteLossError(int(first) - 1, WHAT[int(what)], value, detail)
        raise NonFiniteLossError(None, "loss or gradient norm", math.nan, detail)

    def reset(self) -> None:
        """Forget the record (a fresh start, e.g. after a resume from a good checkpoint)."""
        self._record = None
