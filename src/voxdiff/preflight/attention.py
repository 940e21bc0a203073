"""What ``F.scaled_dot_product_attention`` keeps in memory on the GPU, reproduced on the meta device.

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
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["FlashAttentionEmulator", "flash_attention_applies", "flash_backward_temporaries", "flash_backward_temporary_bytes"]

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

    Enter it *before* (outside) :class:`~voxdiff.preflight.autocast.CudaAutocastEmulator` so that it sees the
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
