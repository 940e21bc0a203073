"""The optimizer of a training step and its learning-rate schedule, from ``system.optim``.

:func:`build_optimizer` is the one place an optimizer is made, and :func:`optimizer_impl` the one place its
implementation is chosen (``foreach``, ``fused`` or ``single``: it decides the memory of ``optimizer.step()``,
see ``tests/preflight/test_memory.py``). The training step (:class:`voxdiff.step.TrainStep`) calls both, whether
Lightning drives it, the preflight traces it or the measure mode runs it. AdamW's state is 2 fp32 tensors per
parameter: ``exp_avg`` and ``exp_avg_sq``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch

from voxdiff.errors import ConfigError, integer, number


@dataclass(frozen=True)
class OptimSettings:
    """The validated ``system.optim`` config."""

    lr: float = 1.0e-4  # peak learning rate (after warm-up)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1.0e-8
    weight_decay: float = 0.0  # decoupled (AdamW); applied to weights with ndim >= 2 only
    foreach: bool | None = None  # None: foreach where torch picks it (a GPU), unless fused
    fused: bool | None = None  # None: fused wherever every parameter is on a CUDA GPU (true: needs that)
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
    number("system.optim.lr", s.lr, lo=0, lo_open=True, example=1e-4)
    if len(s.betas) != 2 or not all(_is_number(b) and 0 <= b < 1 for b in s.betas):
        raise _bad("betas", list(s.betas), "must be two numbers in [0, 1)", "e.g. system.optim.betas=[0.9,0.999]")
    number("system.optim.eps", s.eps, lo=0, lo_open=True, example=1e-8)
    number("system.optim.weight_decay", s.weight_decay, lo=0, example=0.0)
    for key in ("foreach", "fused"):
        if getattr(s, key) not in (None, True, False):
            raise _bad(key, getattr(s, key), "must be true, false or null", f"use system.optim.{key}=null")
    if s.foreach and s.fused:
        raise _bad("fused", s.fused, "cannot be combined with system.optim.foreach=true",
                   "set one of them to null")
    integer("system.optim.warmup_steps", s.warmup_steps, minimum=0, example=500)
    if s.decay_steps is not None:
        integer("system.optim.decay_steps", s.decay_steps, minimum=1, fix="use null to decay over the whole run")
    number("system.optim.min_lr_ratio", s.min_lr_ratio, lo=0, hi=1, example=0.1)
    return s


OPTIMIZER_IMPLS = ("foreach", "fused", "single")


def optimizer_impl(settings: OptimSettings, device_type: str) -> str:
    """The AdamW implementation a run uses with its parameters on ``device_type`` (``cuda``, ``cpu``, or
    ``mixed`` when they are not all on one device type: :func:`params_device_type`).

    ``fused=true`` → ``fused`` (one in-place kernel per parameter group, no temporaries); ``foreach=true`` →
    ``foreach`` (multi-tensor kernels, with a parameter-sized temporary in ``step()``); ``foreach=false`` →
    ``single`` (a loop over parameters). Neither set: ``fused`` wherever every parameter is on a CUDA GPU, else
    ``single``. ``fused=false`` alone: torch's default, ``foreach`` on CUDA and ``single`` elsewhere.
    """
    if settings.fused:
        return "fused"
    if settings.foreach is not None:
        return "foreach" if settings.foreach else "single"
    if device_type != "cuda":
        return "single"
    return "foreach" if settings.fused is False else "fused"


def params_device_type(params: Iterable[torch.Tensor]) -> str:
    """The device type of ``params`` (``cuda``, ``cpu``, ``meta``), or ``mixed`` when they are on several."""
    types = {p.device.type for p in params}
    return types.pop() if len(types) == 1 else "mixed"


def param_groups(params: Iterable[torch.nn.Parameter], weight_decay: float) -> list[dict[str, Any]]:
    """Trainable ``params`` split for AdamW: weights with two or more dimensions (convolutions, linear layers)
    get ``weight_decay``; biases and norm scales get none (nanoGPT's split). One group without weight decay."""
    params = [p for p in params if p.requires_grad]
    if not params:
        raise ValueError("build_optimizer: no trainable parameters")
    if weight_decay == 0:
        return [{"params": params, "weight_decay": 0.0}]
    return [g for g in (
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay, "name": "decay"},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0, "name": "no_decay"},
    ) if g["params"]]  # fmt: skip


def build_optimizer(
    params: Iterable[torch.nn.Parameter], optim_cfg: OptimSettings | Mapping[str, Any], impl: str | None = None
) -> torch.optim.AdamW:
    """AdamW over ``params`` with the settings of ``system.optim``: the optimizer of a training step.

    The learning rate is the peak ``lr``; :class:`WarmupCosine` scales it per step.

    Args:
        params: the parameters to optimise (those with ``requires_grad``; frozen ones are skipped).
        optim_cfg: :class:`OptimSettings` or a plain ``system.optim`` mapping (validated here).
        impl: one of :data:`OPTIMIZER_IMPLS`; None: :func:`optimizer_impl` for the device of the parameters.

    Returns:
        ``torch.optim.AdamW``: see :func:`param_groups`.
    """
    s = optim_cfg if isinstance(optim_cfg, OptimSettings) else optim_settings(optim_cfg)
    groups = param_groups(params, s.weight_decay)
    impl = impl or optimizer_impl(s, params_device_type(p for g in groups for p in g["params"]))
    if impl not in OPTIMIZER_IMPLS:
        raise ValueError(f"impl={impl!r}: use one of {', '.join(OPTIMIZER_IMPLS)}")
    optimizer = torch.optim.AdamW(groups, lr=s.lr, betas=s.betas, eps=s.eps, foreach=impl == "foreach",
                                  fused=impl == "fused")
    optimizer.register_load_state_dict_post_hook(_state_in_parameter_layout)
    return optimizer


def _state_in_parameter_layout(optimizer: torch.optim.Optimizer) -> None:
    """After a checkpoint's state is loaded: each moment in its parameter's memory layout (strides), as AdamW creates
    them. A checkpoint of a ``model.channels_last`` run resumed in the default layout (or the reverse) would
    otherwise pair contiguous weights with channels-last moments, which fused AdamW refuses and foreach AdamW runs
    tensor by tensor."""
    for param, state in optimizer.state.items():
        for key, value in state.items():
            if (isinstance(value, torch.Tensor) and value.shape == param.shape and value.dim() > 1
                    and value.stride() != param.stride()):
                state[key] = torch.empty_like(param, dtype=value.dtype).copy_(value)


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


def clip_gradients(params: Iterable[torch.Tensor], value: float | None, algorithm: str = "norm",
                   optimizer: torch.optim.Optimizer | None = None) -> torch.Tensor:
    """Clip the gradients of ``params`` (``trainer.gradient_clip_val`` / ``gradient_clip_algorithm``) in place,
    without a host sync, and return their total 2-norm before clipping (a device scalar).

    Every system clips through this rather than through Lightning's precision plugin, which refuses an optimizer
    that unscales its own gradients (fused AdamW, voxdiff's default on a GPU) whenever a clip value is set.
    ``norm``: scale every gradient by ``min(1, value / total norm)``; ``value``: clamp each element to
    ``[-value, value]`` (the norm returned is then that of the clamped gradients); ``value=None``: the norm alone.

    ``optimizer``: the optimizer about to step on these gradients. Where it is a fused AdamW (:func:`folds_clip`),
    clipping by norm is not a pass of its own over the gradients: the factor goes to the fused kernel, which reads
    every gradient anyway, as its ``grad_scale`` (the gradients are divided by it, as a GradScaler's unscaling is),
    and the gradients themselves are left as they are. :func:`unfold_clip` removes it after the step. On a
    2.7B-parameter UNet this saves reading and writing 21 GB of fp32 gradients per step.
    """
    params = [p for p in params if p.grad is not None]
    if value is not None and algorithm == "value":
        torch.nn.utils.clip_grad_value_(params, value)
    norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    if hasattr(norm, "full_tensor"):  # a DTensor (FSDP's sharded gradients): the norm over every shard
        norm = norm.full_tensor()
    elif value is not None and algorithm == "norm" and optimizer is not None and folds_clip(optimizer):
        # 1 / the factor clip_grads_with_norm_ multiplies by (min(1, value / (norm + 1e-6))), on the device
        optimizer.grad_scale = torch.clamp((norm.float() + 1e-6) / value, min=1.0)
        return norm
    if value is not None and algorithm == "norm":
        torch.nn.utils.clip_grads_with_norm_(params, value, norm)
    return norm


def folds_clip(optimizer: torch.optim.Optimizer) -> bool:
    """Whether :func:`clip_gradients` hands the clipping factor to ``optimizer``: a fused AdamW (its kernel divides
    the gradients by a ``grad_scale`` tensor). Not to be passed where a loss scaler steps the optimizer (fp16's
    GradScaler sets its own ``grad_scale``)."""
    return isinstance(optimizer, torch.optim.AdamW) and bool(optimizer.defaults.get("fused"))


def unfold_clip(optimizer: torch.optim.Optimizer | None) -> None:
    """After the optimizer step: drop the clipping factor :func:`clip_gradients` gave ``optimizer`` (if any)."""
    if optimizer is not None:
        optimizer.__dict__.pop("grad_scale", None)


def build_lr_scheduler(optimizer: torch.optim.Optimizer, settings: OptimSettings,
                       total_steps: float) -> torch.optim.lr_scheduler.LambdaLR:
    """``LambdaLR`` with :class:`WarmupCosine`, stepped once per optimizer step.

    Args:
        optimizer: the optimizer whose learning rate it scales.
        settings: ``system.optim``.
        total_steps: the run length in optimizer steps (``trainer.estimated_stepping_batches``; inf when
            unbounded), used when ``settings.decay_steps`` is None.

    Raises:
        ConfigError: an unbounded run without ``system.optim.decay_steps`` (the cosine would have no end).
    """
    if settings.decay_steps is None and not math.isfinite(total_steps):
        raise ConfigError("system.optim.decay_steps", None,
                          "the run has no fixed length (trainer.max_steps=-1 and trainer.max_epochs=-1), so "
                          "the cosine decay has no end", "set system.optim.decay_steps or trainer.max_steps")
    decay_steps = settings.decay_steps if settings.decay_steps is not None else max(1, int(total_steps))
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, WarmupCosine(settings.warmup_steps, decay_steps, settings.min_lr_ratio)
    )
