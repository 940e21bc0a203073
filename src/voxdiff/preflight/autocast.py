"""Emulation of CUDA autocast (AMP) for traces that run without a GPU.

CUDA autocast decides the dtype of every op from fixed per-op lists compiled into ATen
(``aten/src/ATen/autocast_mode.h`` / ``autocast_mode.cpp``). CPU autocast uses *different* lists (group_norm
and softmax are not fp32 there), and ``torch.autocast("cuda")`` disables itself without CUDA, so a trace on
the ``meta`` device has to reproduce the CUDA decisions itself.

:class:`CudaAutocastEmulator` is a :class:`~torch.overrides.TorchFunctionMode`, i.e. it runs *above*
autograd, exactly where the real ``Autocast`` dispatch key sits: the casts it inserts are recorded by
autograd, so the tensors saved for backward have the dtypes they have on the GPU (a bf16 copy for a conv
input, an fp32 copy for a group-norm input, ...). Below autograd (in a dispatch mode) the saved tensors
would come out wrong.

The op lists below are those of torch 2.13 (``AT_FORALL_LOWER_PRECISION_FP``, ``AT_FORALL_FP32``,
``AT_FORALL_FP32_SET_OPT_DTYPE``, ``AT_FORALL_PROMOTE`` and the ``norm`` overloads of
``AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE`` in ``ATen/autocast_mode.h``, plus ``cudnn_convolution`` and
``cudnn_convolution_transpose`` registered in ``autocast_mode.cpp``). ``tests/preflight/test_memory.py``
checks them against the header shipped with the installed torch.

Limits of the emulation (documented rather than hidden):

* The policy is looked up by the name of the function that reaches ``__torch_function__``. Builtins (C++
  bindings such as ``torch.conv3d`` or ``Tensor.softmax``) carry the ATen op name. Python-level wrappers whose
  inner call would hit a listed op (``F.interpolate`` -> ``upsample_*``, ``F.softmax``) are mapped by hand in
  :data:`_PYTHON_WRAPPERS`. A composite *builtin* that is not listed but calls a listed op internally would
  run its inner op in the dtype it receives (no such op appears in MONAI's diffusion UNet).
* ``torch.autocast(...)`` regions that the traced code opens itself — MONAI's vector quantiser and voxdiff's
  VQ-VAE encoding run in fp32 inside ``torch.autocast(..., enabled=False)`` — are honoured for the ``cuda`` device
  and the emulated one: while the mode is active, ``torch.autocast`` opens an emulated region (a disabled one
  casts nothing until it exits); other device types get the real ``torch.autocast``.
* Autocast's cache of bf16 weight copies lives until the outermost emulated region exits, as in ATen, and is not
  used under ``torch.inference_mode()`` (ATen casts the weights afresh at every op there: each copy dies with its
  op). Lightning runs validation, and the sampling at its end, in inference mode; ``sample.py`` runs under
  ``torch.no_grad()``, where the cache is used.
  During backward (where only recomputation by ``torch.utils.checkpoint`` issues Python-level calls), the
  cache is off: on the GPU each recomputed segment re-enters autocast as its own outermost region, so its
  weight casts die with the segment's saved tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = [
    "CUDA_FP32_OPS",
    "CUDA_FP32_SET_OPT_DTYPE_OPS",
    "CUDA_LOWER_PRECISION_OPS",
    "CUDA_PROMOTE_OPS",
    "CudaAutocastEmulator",
]

# --- torch 2.13, ATen/autocast_mode.h: AT_FORALL_LOWER_PRECISION_FP (+ cudnn_* from autocast_mode.cpp) ---
CUDA_LOWER_PRECISION_OPS: frozenset[str] = frozenset(
    {
        "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d", "conv_transpose2d",
        "conv_transpose3d", "convolution", "prelu", "addmm", "addmv", "addr", "matmul", "einsum", "mm", "mv",
        "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot",
        "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell", "rnn_tanh_cell",
        "rnn_relu_cell", "_scaled_dot_product_flash_attention", "scaled_dot_product_attention",
        "cudnn_convolution", "cudnn_convolution_transpose",
    }
)  # fmt: skip

# --- AT_FORALL_FP32, plus norm (fp32_append_dtype, AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE) ---
CUDA_FP32_OPS: frozenset[str] = frozenset(
    {
        "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
        "sinh", "tan", "pow", "softplus", "layer_norm", "native_layer_norm", "rms_norm", "group_norm",
        "frobenius_norm", "nuclear_norm", "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss",
        "nll_loss", "nll_loss2d", "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss",
        "mse_loss", "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
        "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm",
        "logsumexp", "upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d",
        "_upsample_nearest_exact2d", "upsample_nearest3d", "_upsample_nearest_exact3d", "upsample_linear1d",
        "upsample_bilinear2d", "_upsample_bilinear2d_aa", "upsample_trilinear3d", "upsample_bicubic2d",
        "_upsample_bicubic2d_aa",
        "norm",
    }
)  # fmt: skip

# --- AT_FORALL_FP32_SET_OPT_DTYPE: run with dtype=float32 unless the caller gave a dtype ---
CUDA_FP32_SET_OPT_DTYPE_OPS: frozenset[str] = frozenset(
    {"prod", "softmax", "log_softmax", "cumprod", "cumsum", "linalg_vector_norm", "linalg_matrix_norm", "sum"}
)

# --- AT_FORALL_PROMOTE: cast every floating input to the widest floating dtype among them ---
CUDA_PROMOTE_OPS: frozenset[str] = frozenset(
    {"addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler", "index_put",
     "tensordot", "scatter_add"}
)  # fmt: skip

# Python operators that reach __torch_function__ under a dunder name.
_DUNDER_ALIASES: dict[str, str] = {
    "__matmul__": "matmul",
    "__rmatmul__": "matmul",
    "__pow__": "pow",
    "__rpow__": "pow",
}

# F.interpolate mode -> the ATen op it lowers to (suffix 1d/2d/3d added from the input rank where needed).
_INTERPOLATE_OPS: dict[str, str] = {
    "nearest": "upsample_nearest{n}d",
    "nearest-exact": "_upsample_nearest_exact{n}d",
    "linear": "upsample_linear1d",
    "bilinear": "upsample_bilinear2d",
    "trilinear": "upsample_trilinear3d",
    "bicubic": "upsample_bicubic2d",
    "area": "adaptive_avg_pool{n}d",  # not in the CUDA lists: runs in the input dtype
}

_FLOATING = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _interpolate_op_name(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """Name of the ATen op ``F.interpolate`` will call for these arguments."""
    mode = kwargs.get("mode", args[3] if len(args) > 3 else "nearest")
    x = args[0] if args else kwargs["input"]
    template = _INTERPOLATE_OPS.get(mode, "")
    return template.format(n=x.dim() - 2)


def _python_wrapper_name(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """Map Python-level wrappers (whose inner builtin call the mode would not see) to the ATen op name."""
    if func is F.interpolate:
        return _interpolate_op_name(args, kwargs)
    return None


# Where a positional ``dtype`` can sit for fp32_set_opt_dtype ops (elsewhere ``dtype`` is keyword-only):
# ``softmax(input, dim, dtype)`` / ``Tensor.softmax(dim, dtype)``; ``F.softmax(input, dim, _stacklevel, dtype)``.
_DTYPE_POSITION_BY_NAME: dict[str, int] = {"softmax": 2, "log_softmax": 2}
_DTYPE_POSITION_BY_FUNC: dict[Callable[..., Any], int] = {F.softmax: 3, F.log_softmax: 3}


class CudaAutocastEmulator(TorchFunctionMode):
    """TorchFunctionMode applying CUDA autocast's per-op dtype policy to tensors of any device.

    Use it as a context manager around the whole traced step; open autocast *regions* with
    :meth:`region` (the equivalent of ``with torch.autocast("cuda", dtype=...)``). Outside a region, or
    when constructed with ``enabled=False``, it passes every call through unchanged.

    Args:
        dtype: the lower-precision dtype (``torch.bfloat16`` for "bf16-mixed", ``torch.float16`` for fp16).
        device_type: device type of the tensors that count as "on the GPU" (``"meta"`` when tracing).
        enabled: if False, the mode never casts.
    """

    def __init__(self, dtype: torch.dtype = torch.bfloat16, device_type: str = "meta", enabled: bool = True):
        super().__init__()
        self.dtype = dtype
        self.device_type = device_type
        self.enabled = enabled
        self._depth = 0
        self._in_backward = False
        self._suspended = False  # inside a torch.autocast(enabled=False) region of the traced code
        self._real_autocast: Any = None
        # id(fp32 leaf) -> (leaf, cast copy); the strong ref to the leaf keeps the id unique, as ATen's weakref does.
        self._cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.calls: dict[str, int] = {}  # op name -> calls seen inside regions

    # ----------------------------------------------------------------------------------------- regions
    def region(self) -> _AutocastRegion:
        """Context manager for one autocast region (nested regions share the weight-cast cache)."""
        return _AutocastRegion(self)

    def backward_region(self) -> _AutocastRegion:
        """Context manager for the backward pass: casts (for checkpoint recomputation) but caches nothing."""
        return _AutocastRegion(self, backward=True)

    def __enter__(self) -> CudaAutocastEmulator:
        self._real_autocast = torch.autocast
        torch.autocast = self._torch_autocast  # type: ignore[assignment,misc]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> Any:
        torch.autocast = self._real_autocast  # type: ignore[misc]
        return super().__exit__(*exc)

    def _torch_autocast(self, device_type: str, dtype: torch.dtype | None = None, enabled: bool = True,
                        cache_enabled: bool | None = None) -> Any:
        """``torch.autocast`` while the mode is active: an emulated region for ``cuda`` and the emulated device
        (disabled: no casts inside it), the real context manager for other devices."""
        if device_type in ("cuda", self.device_type):
            return _AutocastRegion(self, backward=None, enabled=enabled)
        return self._real_autocast(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)

    def calls_of(self, name: str) -> int:
        """How many calls of the op ``name`` were seen inside regions (counted even when not enabled)."""
        return self.calls.get(name, 0)

    def clear_cache(self) -> None:
        """Drop the cached weight casts (ATen does this when the outermost region exits)."""
        self._cache.clear()

    # ----------------------------------------------------------------------------------------- casting
    def _eligible(self, t: Any) -> bool:
        return isinstance(t, torch.Tensor) and t.device.type == self.device_type and t.dtype in _FLOATING

    def _cast(self, t: Any, to: torch.dtype) -> Any:
        if not self._eligible(t) or t.dtype == to:
            return t
        can_cache = (
            not self._in_backward
            and not torch.is_inference_mode_enabled()
            and to == self.dtype
            and t.dtype == torch.float32
            and t.requires_grad
            and t.is_leaf
            and not t._is_view()
        )
        if can_cache:
            hit = self._cache.get(id(t))
            if hit is not None and hit[0] is t:
                return hit[1]
            casted = t.to(to)
            self._cache[id(t)] = (t, casted)
            return casted
        return t.to(to)

    def _cast_all(self, obj: Any, to: torch.dtype) -> Any:
        if isinstance(obj, torch.Tensor):
            return self._cast(obj, to)
        if isinstance(obj, (list, tuple)):
            return type(obj)(self._cast_all(o, to) for o in obj)
        return obj

    def _widest(self, objs: Any) -> torch.dtype | None:
        widest: torch.dtype | None = None
        stack = list(objs)
        while stack:
            o = stack.pop()
            if isinstance(o, (list, tuple)):
                stack.extend(o)
            elif self._eligible(o):
                widest = o.dtype if widest is None else torch.promote_types(widest, o.dtype)
        return widest

    # ----------------------------------------------------------------------------------------- dispatch
    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = dict(kwargs or {})
        if self._depth == 0 or self._suspended:
            return func(*args, **kwargs)
        name = _python_wrapper_name(func, args, kwargs) or getattr(func, "__name__", "")
        name = _DUNDER_ALIASES.get(name, name)
        self.calls[name] = self.calls.get(name, 0) + 1
        if not self.enabled:
            return func(*args, **kwargs)
        if name in CUDA_LOWER_PRECISION_OPS:
            args = self._cast_all(args, self.dtype)
            kwargs = {k: self._cast_all(v, self.dtype) for k, v in kwargs.items()}
        elif name in CUDA_FP32_OPS:
            args = self._cast_all(args, torch.float32)
            kwargs = {k: self._cast_all(v, torch.float32) for k, v in kwargs.items()}
        elif name in CUDA_FP32_SET_OPT_DTYPE_OPS:
            pos = _DTYPE_POSITION_BY_FUNC.get(func, _DTYPE_POSITION_BY_NAME.get(name, len(args)))
            first = args[0] if args else next(iter(kwargs.values()), None)
            if self._eligible(first) and kwargs.get("dtype") is None and len(args) <= pos:
                kwargs["dtype"] = torch.float32
        elif name in CUDA_PROMOTE_OPS:
            to = self._widest((args, tuple(kwargs.values())))
            if to is not None:
                args = self._cast_all(args, to)
                kwargs = {k: self._cast_all(v, to) for k, v in kwargs.items()}
        return func(*args, **kwargs)


class _AutocastRegion:
    """One (possibly nested) emulated ``torch.autocast`` region.

    Args:
        backward: a region of the backward pass (casts, caches nothing); None: as the enclosing region.
        enabled: False for ``torch.autocast(..., enabled=False)``: no casts until the region exits.
    """

    def __init__(self, mode: CudaAutocastEmulator, backward: bool | None = False, enabled: bool = True):
        self.mode = mode
        self.backward = backward
        self.enabled = enabled
        self._prev: tuple[bool, bool] = (False, False)

    def __enter__(self) -> CudaAutocastEmulator:
        self._prev = (self.mode._in_backward, self.mode._suspended)
        if self.backward is not None:
            self.mode._in_backward = self.backward
        self.mode._suspended = not self.enabled
        self.mode._depth += 1
        return self.mode

    def __exit__(self, *exc: object) -> None:
        self.mode._depth -= 1
        self.mode._in_backward, self.mode._suspended = self._prev
        if self.mode._depth == 0:
            self.mode.clear_cache()
