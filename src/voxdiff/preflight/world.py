"""The traced world of every prediction, set up once: meta tensors standing for a GPU, with what the GPU would do
that meta tensors do not (CUDA autocast, FlashAttention-2, the ranks of a DDP or FSDP run), the allocator's
bookkeeping, and a training step (or a stage-1 optimizer) whose optimizer runs on meta.

The step's trace (:mod:`voxdiff.preflight.memory`), validation and sampling (the same module) and
stage 1 (:mod:`voxdiff.preflight.stage1`) each run the system's own code inside it:

* :func:`emulated_precision`: the precision context of a traced step, :class:`EmulatedPrecision` around a
  :class:`CudaAutocastEmulator` of the run's precision (the dtypes of
  :data:`voxdiff.step.precision.AUTOCAST_DTYPES`);
* :func:`meta_optimizer`: AdamW as the run configures it, :class:`FusedAdamWOnMeta` for the fused one (which torch
  refuses on meta);
* :func:`meta_step`: the :class:`~voxdiff.step.TrainStep` of a model on meta, with both of the above, decided for
  ``cuda`` (meta stands for a GPU);
* :func:`tracker_for`, :class:`PhaseRecorder`, :class:`PhaseTrace`: the storage tracker as the traces make it, and
  the peaks of named phases.

The module is written in four parts, each with its own account below, in this order: CUDA autocast, FlashAttention-2,
one rank of DDP or FSDP, and the set-up above. Nothing here reads a config or a run spec: the predictions hand their
parts in.

**CUDA autocast.** Emulation of CUDA autocast (AMP) for traces that run without a GPU.

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
  ``torch.no_grad()``, where the cache is used for weights that require gradients, which it freezes
  (:meth:`voxdiff.step.TrainStep.fold_ema`).
  During backward (where only recomputation by ``torch.utils.checkpoint`` issues Python-level calls), the
  cache is off: on the GPU each recomputed segment re-enters autocast as its own outermost region, so its
  weight casts die with the segment's saved tensors.

**FlashAttention-2.** What ``F.scaled_dot_product_attention`` keeps in memory on the GPU, reproduced on the meta
device.

On ``meta`` (and on the CPU) SDPA takes the *math* path, which materialises the ``(B, heads, N, N)`` score
matrix. On an sm80+ GPU with bf16/fp16 inputs, head_dim <= 256 and no explicit mask, it takes FlashAttention-2
instead, which never materialises scores. :class:`FlashAttentionEmulator` replaces every SDPA call by an
autograd function that allocates exactly the tensors FlashAttention-2 allocates (torch's vendored
``flash_attn/flash_api.cpp``, ``mha_fwd`` / ``mha_bwd``):

* forward: the output (padded head_dim, laid out ``(B, N, H, D)``), the fp32 log-sum-exp ``(B, H, N)``; saved
  for backward: q, k, v, out and the log-sum-exp.
* backward: dq, dk, dv (input dtype), and two fp32 temporaries: ``softmax_d`` ``(B, H, round128(N))`` and
  ``dq_accum`` ``(B, round128(N), H, round(D, 32 if D <= 128 else 64))``.

Outside those conditions (a GPU below sm80 such as a V100, head_dim > 256, fp32 inputs, an attention mask) the
GPU picks another kernel; the emulator then leaves the call alone so that the math path is traced, which
over-estimates when the memory-efficient kernel would run (it, too, keeps no O(N^2) tensor). The report names
which path was taken.

**One rank of DDP or FSDP.** What one rank of a DDP or FSDP run holds: the training step traced as rank 0 of N runs
it, without N processes.

The preflight traces the real thing rather than dividing totals: :func:`fake_world` stands in for N ranks with
torch's *fake* process group (one process; every collective returns at once, moves no data, and its output
tensors are those the caller allocated, as on a GPU), and :func:`wrap_for_rank` wraps the meta-device UNet as
``train.py`` does on each GPU:

* ``ddp``: torch's ``DistributedDataParallel`` with the configured ``gradient_as_bucket_view`` and
  ``bucket_cap_mb`` (``configs/trainer/ddp.yaml``) — its reducer allocates the gradient buckets; with
  ``gradient_as_bucket_view=true`` the gradients are views into them, else a second copy;
* ``fsdp``: :func:`voxdiff.models.sharding.shard_unet`, the function ``DiffusionSystem.configure_model``
  calls — FSDP2 shards every parameter over the ranks (dim-0 rows, padded to equal shards), gathers a unit's
  weights into its all-gather buffers for its forward and again for its backward, reduce-scatters its
  gradients, and the optimizer's moments and the EMA are made from the shards.

The traced step is then the same :class:`~voxdiff.step.TrainStep` as for one GPU, and the storage tracker counts
what this rank allocates: its shards, the unit in flight, the buckets. FSDP2 runs on meta tensors here through
three substitutions, made only inside :func:`fake_world`: its device is ``meta`` (not the mesh's), ``meta`` gets
the CPU's stream and event stubs (no streams: frees are immediate, as on the CPU), and its check that no parameter
is on meta is skipped. ``tests/preflight/test_distributed_memory.py`` checks the result against the CPU allocator
in real two-process gloo runs of DDP and FSDP.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from voxdiff.diffusion import Process
from voxdiff.encodings.base import Encoding
from voxdiff.models.sharding import shard_unet
from voxdiff.preflight.tracker import BLOCK_BYTES, StorageTracker
from voxdiff.run.spec import Parallel
from voxdiff.step import OptimSettings, Recipe, TrainStep
from voxdiff.step.optim import build_optimizer
from voxdiff.step.precision import AUTOCAST_DTYPES

__all__ = ["CUDA_FP32_OPS", "CUDA_FP32_SET_OPT_DTYPE_OPS", "CUDA_LOWER_PRECISION_OPS", "CUDA_PROMOTE_OPS",
           "PREDICTED_DEVICE", "CudaAutocastEmulator", "EmulatedPrecision", "FlashAttentionEmulator",
           "FusedAdamWOnMeta", "PhaseRecorder", "PhaseTrace", "emulated_precision", "fake_world",
           "flash_attention_applies", "flash_backward_temporaries", "flash_backward_temporary_bytes", "meta_optimizer",
           "meta_step", "tracker_for", "wrap_for_rank"]


# -------------------------------------------------------------------------------------------------------- CUDA autocast
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


# ----------------------------------------------------------------------------------------------------- FlashAttention-2
_FLASH_MAX_HEAD_DIM = 256  # FlashAttention-2 supports head dims up to 256 (sdp_utils: check_head_dim_size_flash)
_FLASH_MIN_CAPABILITY = (8, 0)  # sdp_utils: check_flash_attention_hardware_support (sm80 and later)


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def flash_attention_applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Any,
                            capability: tuple[int, int] = (9, 0)) -> bool:
    """Whether SDPA would dispatch to FlashAttention-2 for these inputs on a GPU of compute ``capability``.

    Args:
        q: query ``(B, H, N, D)``; k, v: keys and values of matching head dim.
        attn_mask: the ``attn_mask`` argument (flash accepts none).
        capability: the GPU's ``(major, minor)``; FlashAttention-2 needs sm80 or later (torch's ``sdp_utils``).
    """
    return (
        tuple(capability) >= _FLASH_MIN_CAPABILITY
        and attn_mask is None
        and q.dtype in (torch.float16, torch.bfloat16)
        and q.dtype == k.dtype == v.dtype
        and q.dim() == 4
        and q.shape[-1] <= _FLASH_MAX_HEAD_DIM
        and q.shape[-1] == k.shape[-1] == v.shape[-1]
    )


def flash_backward_temporaries(q: torch.Tensor) -> tuple[tuple[int, ...], ...]:
    """Shapes of the fp32 temporaries FlashAttention-2's backward holds besides its outputs, for a query
    ``(B, H, N, D)``: ``softmax_d`` ``(B, H, round128(N))`` and ``dq_accum``
    ``(B, round128(N), H, round(D, 32 if D <= 128 else 64))``."""
    b, h, n, d = q.shape
    n_r = _round_up(n, 128)
    d_r = _round_up(d, 32 if d <= 128 else 64)
    return (b, h, n_r), (b, n_r, h, d_r)


def flash_backward_temporary_bytes(q: torch.Tensor) -> int:
    """Bytes of :func:`flash_backward_temporaries` for a bf16/fp16 query, each rounded to the CUDA allocator's
    512 B; 0 for other dtypes (the GPU runs another kernel)."""
    if q.dtype not in (torch.float16, torch.bfloat16):
        return 0
    return sum(_round_up(math.prod(shape) * 4, 512) for shape in flash_backward_temporaries(q))


class _FlashAttentionMemory(torch.autograd.Function):
    """Allocates (on any device) what FlashAttention-2 allocates; the values are meaningless."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        b, h, n, d = q.shape
        d_pad = _round_up(d, 8)  # mha_fwd pads the head dim to a multiple of 8
        out = torch.empty((b, n, h, d_pad), dtype=q.dtype, device=q.device)[..., :d].transpose(1, 2)
        lse = torch.empty((b, h, n), dtype=torch.float32, device=q.device)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, dout: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v, _out, _lse = ctx.saved_tensors
        if dout.stride(-1) != 1:
            dout = dout.contiguous()
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        temporaries = [torch.empty(s, dtype=torch.float32, device=q.device) for s in flash_backward_temporaries(q)]
        del temporaries
        return dq, dk, dv


class FlashAttentionEmulator(TorchFunctionMode):
    """TorchFunctionMode that traces SDPA calls as FlashAttention-2 where the GPU would use it.

    Enter it *before* (outside) :class:`CudaAutocastEmulator` so that it sees the
    autocast-cast q, k, v. Counts the calls it replaced (``flash_calls``) and those it left to the math path
    (``math_calls``): all of them on a GPU below sm80 (``capability``), where SDPA takes another kernel.
    """

    def __init__(self, capability: tuple[int, int] = (9, 0)) -> None:
        super().__init__()
        self.capability = tuple(capability)
        self.flash_calls = 0
        self.math_calls = 0

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        names = ("query", "key", "value", "attn_mask")
        bound = dict(zip(names, args))
        bound.update({k: v for k, v in kwargs.items() if k in names})
        q, k, v = bound["query"], bound["key"], bound["value"]
        if flash_attention_applies(q, k, v, bound.get("attn_mask"), self.capability):
            self.flash_calls += 1
            return _FlashAttentionMemory.apply(q, k, v)
        self.math_calls += 1
        return func(*args, **kwargs)


# ---------------------------------------------------------------------------------------------- one rank of DDP or FSDP
@contextlib.contextmanager
def fake_world(world_size: int) -> Iterator[Any]:
    """Be rank 0 of ``world_size`` ranks in this one process, for a trace on meta tensors; yields a 1-D
    ``DeviceMesh`` on ``meta`` over them. See the module docstring for what is substituted while inside.

    Raises:
        RuntimeError: a process group is initialised already (a real run): the trace would replace it.
    """
    import torch.distributed as dist
    import torch.distributed.device_mesh as device_mesh
    import torch.distributed.fsdp._fully_shard._fsdp_collectives as collectives
    import torch.distributed.fsdp._fully_shard._fsdp_init as fsdp_init
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as param_group
    import torch.distributed.fsdp._fully_shard._fsdp_state as fsdp_state
    import torch.distributed.fsdp._fully_shard._fully_shard as fully_shard
    import torch.nn.parallel.distributed as ddp
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("fake_world: a process group is initialised already; trace before the run starts")

    original_handle = device_mesh._get_device_handle

    def device_handle(device_type: str = "cuda") -> Any:
        return torch.cpu if device_type == "meta" else original_handle(device_type)

    patches = [(fully_shard, "_get_device_from_mesh", lambda mesh: torch.device("meta")),
               (ddp, "_verify_param_shape_across_processes", lambda *args, **kwargs: None),
               (ddp, "_sync_module_states", lambda *args, **kwargs: None),
               (param_group.FSDPParamGroup, "_validate_no_meta_params", lambda self: None),
               *[(m, "_get_device_handle", device_handle)
                 for m in (device_mesh, collectives, fsdp_init, param_group, fsdp_state)]]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        for obj, name, value in patches:
            setattr(obj, name, value)
        with _MetaRoundTrip():
            yield device_mesh.init_device_mesh("meta", (world_size,))
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)
        dist.destroy_process_group()


class _MetaRoundTrip(TorchDispatchMode):
    """Give back the CPU data of a small tensor that went to ``meta`` and returns to the CPU.

    DDP sends its bucket assignment from rank 0 to the others by copying (``copy_``) a small CPU tensor of indices
    to the parameters' device, broadcasting it and copying it back (when it rebuilds its buckets in the order the
    gradients came, before the second forward). On meta the copy back has no data; the fake broadcast changed
    nothing, so the data is the CPU tensor that went in.
    """

    _LIMIT = 1 << 20  # elements: the indices of a UNet's parameters, never activations

    def __init__(self) -> None:
        super().__init__()
        self._sources: dict[int, tuple[weakref.ref[torch.Tensor], torch.Tensor]] = {}  # id(meta) -> (ref, CPU data)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten.copy_.default:
            dst, src = args[0], args[1]
            if dst.device.type == "cpu" and src.device.type == "meta":
                ref, data = self._sources.get(id(src), (None, None))
                if ref is not None and ref() is src:
                    return dst.copy_(data)
            if dst.device.type == "meta" and src.device.type == "cpu" and src.numel() <= self._LIMIT:
                self._sources = {k: v for k, v in self._sources.items() if v[0]() is not None}
                self._sources[id(dst)] = (weakref.ref(dst), src.clone())
        return func(*args, **kwargs)


def wrap_for_rank(model: nn.Module, parallel: Parallel, mesh: Any) -> nn.Module:
    """``model`` as one rank runs it under ``parallel`` (inside :func:`fake_world`, or a real process group):
    DDP-wrapped, sharded (FSDP, in place), or as it is."""
    if parallel.strategy == "ddp":
        import torch.distributed as dist

        ddp = nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=parallel.gradient_as_bucket_view,
                                                  bucket_cap_mb=parallel.bucket_cap_mb)
        if dist.get_backend() == "fake":  # its all-reduce has no result: stand in for the built-in hook, which
            ddp.register_comm_hook(None, _bucket_as_reduced)  # reduces the bucket in place (no allocation)
        return ddp
    if parallel.strategy == "fsdp":
        return shard_unet(model, mesh)
    return model


def _bucket_as_reduced(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks the annotations: none
    """A DDP communication hook for the fake process group: the bucket, as the built-in all-reduce returns it."""
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


# --------------------------------------------------------------------------------------------- the traced world, set up
PREDICTED_DEVICE = "cuda"
"""The device the preflight predicts a run on, which the meta tensors stand for: a GPU. It resolves the model's
``auto`` switches for it (SDPA attention on: :meth:`voxdiff.models.UNetSpec.for_device`) and picks the optimizer torch
runs there (fused AdamW)."""


class EmulatedPrecision:
    """The precision context of a traced :class:`~voxdiff.step.TrainStep`: CUDA autocast emulated on meta tensors.

    The forward runs in an emulated autocast region; the backward keeps the emulation active for the whole
    backward pass (``torch.utils.checkpoint`` recomputation re-enters autocast, as on the GPU); there is no loss
    scaler (fp16 AMP's ``GradScaler`` holds a few scalars and unscales in place).
    """

    scales_loss = False

    def __init__(self, autocast: CudaAutocastEmulator) -> None:
        self.autocast = autocast

    def forward(self) -> Any:
        return self.autocast.region()

    def backward(self, loss: Tensor) -> None:
        with self.autocast.backward_region():
            _run_backward(loss)

    def unscale(self, optimizer: Any) -> None:
        pass

    def step(self, optimizer: Any) -> None:
        optimizer.step()


class FusedAdamWOnMeta:
    """Stand-in for ``torch.optim.AdamW(fused=True)``, which refuses meta tensors.

    It allocates what the fused optimizer allocates (``exp_avg`` and ``exp_avg_sq`` like the parameter, and a
    0-dim fp32 ``step`` per parameter on the device on the first step) and updates with the real
    ``torch._fused_adamw_`` kernel, which works in place (no temporaries).
    """

    def __init__(self, params: Iterable[nn.Parameter], settings: OptimSettings) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.param_groups = [{"params": self.params}]
        self.settings = settings
        self.state: dict[nn.Parameter, dict[str, Tensor]] = {}

    @torch.no_grad()
    def step(self) -> None:
        ps = [p for p in self.params if p.grad is not None]
        for p in ps:
            if p not in self.state:
                self.state[p] = {
                    "step": torch.zeros((), dtype=torch.float32, device=p.device),
                    "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
                }
        if not ps:
            return
        st = [self.state[p] for p in ps]
        s = self.settings
        torch._foreach_add_([x["step"] for x in st], 1)
        torch._fused_adamw_(
            ps, [p.grad for p in ps], [x["exp_avg"] for x in st], [x["exp_avg_sq"] for x in st], [],
            [x["step"] for x in st], lr=s.lr, beta1=s.betas[0], beta2=s.betas[1], weight_decay=s.weight_decay,
            eps=s.eps, amsgrad=False, maximize=False,
        )  # fmt: skip

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None


def emulated_precision(precision: str) -> EmulatedPrecision:
    """The emulated precision context of a step traced in ``precision`` (``bf16-mixed``, ``16-mixed``, ``32-true``,
    as :func:`voxdiff.step.decide_precision` decided it): CUDA autocast to its dtype on meta, disabled for fp32."""
    dtype = AUTOCAST_DTYPES[precision]
    return EmulatedPrecision(CudaAutocastEmulator(dtype=dtype or torch.bfloat16, device_type="meta",
                                                  enabled=dtype is not None))


def meta_optimizer(params: Iterable[nn.Parameter], settings: OptimSettings, impl: str) -> Any:
    """AdamW over ``params`` as ``settings`` configure it in implementation ``impl``
    (:func:`voxdiff.step.optim.optimizer_impl`): the fused one's stand-in on meta, else torch's own."""
    params = list(params)
    return FusedAdamWOnMeta(params, settings) if impl == "fused" else build_optimizer(params, settings, impl)


def meta_step(model: nn.Module, recipe: Recipe, precision: str, *, encoding: Encoding | None = None,
              mode: str = "bravo", process: Process | None = None) -> TrainStep:
    """The training step of ``model`` (on meta) as the GPU run makes it: ``recipe``, ``precision`` emulated
    (:func:`emulated_precision`), its optimizer implementation decided for ``cuda`` (the meta tensors stand for a
    GPU) and configured (:class:`FusedAdamWOnMeta` for fused AdamW)."""
    step = TrainStep(model, recipe, encoding=encoding, mode=mode, process=process,
                     precision=emulated_precision(precision), device_type=PREDICTED_DEVICE)
    trainable = [p for p in model.parameters() if p.requires_grad]
    step.configure_optimizer(optimizer=FusedAdamWOnMeta(trainable, recipe.optim)
                             if step.optimizer_impl == "fused" else None)
    return step


def tracker_for(device_type: str, granularity: int | None = None, cuda_kernels: bool | None = None) -> StorageTracker:
    """A tracker as the step's trace makes it: on ``meta`` (standing for a GPU) the CUDA allocator's 512 B rounding
    and the CUDA kernels' temporaries; elsewhere (real CPU tensors, checked against the CPU allocator) neither."""
    on_meta = device_type == "meta"
    kernels = on_meta if cuda_kernels is None else cuda_kernels
    return StorageTracker(device_type=device_type, record_events=True,
                          granularity=granularity or (BLOCK_BYTES if on_meta else 1),
                          kernel_temporaries=None if kernels else {})


class PhaseRecorder:
    """A :class:`~voxdiff.step.PhaseProbe` that keeps the tracker's peak of every named phase, per step (a phase that
    occurs twice in a step keeps the larger peak)."""

    def __init__(self, tracker: StorageTracker) -> None:
        self.tracker = tracker
        self.current: dict[str, int] = {}
        self.steps: list[dict[str, int]] = []
        self.open: str | None = None

    def begin(self, phase: str) -> None:
        self.tracker.begin_phase(f"{phase}{len(self.steps) + 1}")
        self.open = phase

    def end(self, phase: str) -> None:
        self.current[phase] = max(self.current.get(phase, 0), self.tracker.end_phase().peak)
        self.open = None

    def switch(self, phase: str) -> None:
        """End the open phase (if any) and begin ``phase`` (e.g. from an autograd hook in the middle of backward)."""
        if self.open is not None:
            self.end(self.open)
        self.begin(phase)

    def finish_step(self) -> dict[str, int]:
        """Close the step: its phase peaks are appended to :attr:`steps` and returned."""
        self.steps.append(self.current)
        self.current = {}
        return self.steps[-1]


@dataclass
class PhaseTrace:
    """Raw result of a traced phase: peaks per named phase and the live bytes at the start (no workspaces).

    Attributes:
        peaks: phase name -> peak live bytes (``max_memory_allocated`` after a reset at the phase start).
        start_bytes: live bytes when tracing began (what was resident: weights, optimizer state, EMA, ...).
        events: the allocation/free sequence for :func:`voxdiff.preflight.tracker.simulate_reserved`.
    """

    peaks: dict[str, int]
    start_bytes: int
    events: list[tuple[int, int, int]]

    @property
    def peak(self) -> int:
        return max(self.peaks.values())


def _run_backward(loss: Tensor) -> None:
    """``loss.backward()`` that keeps the emulation modes active for the whole backward pass.

    ``Tensor.backward`` and ``torch.autograd.backward`` dispatch through ``__torch_function__``, and a
    TorchFunctionMode is popped while it handles a call: the backward (and the recomputation that
    ``torch.utils.checkpoint`` runs inside it) would then run without CUDA-autocast emulation, whereas on the
    GPU checkpoint re-enters autocast for the recomputation. Calling the autograd engine directly, as
    ``torch.autograd.backward`` does after its ``__torch_function__`` check, avoids that.
    """
    from torch.autograd.graph import _engine_run_backward

    _engine_run_backward(
        (loss,), (torch.ones_like(loss),), False, False, (), allow_unreachable=True, accumulate_grad=True
    )
