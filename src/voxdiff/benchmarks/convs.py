"""The convolutions of a training step, one by one: which cuDNN calls the step makes, and how fast each runs.

The time model (:data:`voxdiff.preflight.resources.STEP_THROUGHPUT`) gives every UNet one FLOP rate (the CUDA-graph
step's adds a fixed cost per convolution, in its weight's bytes, and a rate for the step's traffic), but on an H200 the
2.7B UNet's wide convolutions ran at 49% of the dense bf16 peak and exp11's narrow ones at 23% (README, "Measured in
session 22"); a roofline of exp11's step at batch 32 says 163 ms against 456 measured, 109 ms of it convolutions.
:func:`step_convolutions` records every convolution the step calls — forward (``aten.convolution``) and backward
(``aten.convolution_backward``, with the gradients it computes), the recomputations of gradient checkpointing
included — by tracing the preflight's own step on the meta device (:func:`voxdiff.preflight.check.run_step_cost`),
so the shapes are the step's, not a guess. :func:`time_convolution` then runs one such call alone on a device, in a
memory layout (``torch.contiguous_format``, NCDHW, or ``torch.channels_last_3d``, NDHWC) and with or without cuDNN's
autotuner, and ``bench/bench_convs.py`` sums them per step: what the convolutions of a step cost in each setting,
measured in one run, without compiling the step.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode
from voxdiff.preflight.check import run_step_cost, traced_unet
from voxdiff.preflight.resources import StepCost
from voxdiff.run.spec import RunSpec

Shape = tuple[int, ...]

#: the memory layouts :func:`time_convolution` takes, by the name the tables print
LAYOUTS = {"NCDHW": torch.contiguous_format, "NDHWC": torch.channels_last_3d}


@dataclass(frozen=True)
class ConvCall:
    """One convolution call of a step, as ATen receives it (the same fields for a forward and its backward).

    Attributes:
        kind: ``forward`` (``aten.convolution``) or ``backward`` (``aten.convolution_backward``).
        input: the input's shape ``(N, C_in, D, H, W)``.
        weight: the weight's shape ``(C_out, C_in / groups, kD, kH, kW)``.
        bias: whether the call has a bias (forward), or computes its gradient (backward).
        stride, padding, dilation, transposed, output_padding, groups: as :func:`torch.nn.functional.conv3d`.
        grads: backward only: whether it computes the input's gradient and the weight's (the step's first
            convolution takes the noisy input, which needs none).
    """

    kind: str
    input: Shape
    weight: Shape
    bias: bool
    stride: Shape
    padding: Shape
    dilation: Shape
    transposed: bool
    output_padding: Shape
    groups: int
    grads: tuple[bool, bool] = (False, False)

    @property
    def output(self) -> Shape:
        """The forward's output shape (computed on the meta device)."""
        with torch.device("meta"):
            x, w = torch.empty(self.input), torch.empty(self.weight)
            return tuple(torch.ops.aten.convolution(x, w, None, list(self.stride), list(self.padding),
                                                    list(self.dilation), self.transposed,
                                                    list(self.output_padding), self.groups).shape)

    @property
    def label(self) -> str:
        """e.g. ``fwd 32x64x80x64x64 k64x64x3x3x3 s1``, ``bwd(in,w) ...``, ``bwd(w) ...``."""
        what = "fwd" if self.kind == "forward" else (
            "bwd(" + ",".join(n for n, g in zip(("in", "w"), self.grads, strict=True) if g) + ")")
        stride = "s" + "x".join(map(str, sorted(set(self.stride))))
        return (f"{what} {'x'.join(map(str, self.input))} k{'x'.join(map(str, self.weight))} {stride}"
                + (" T" if self.transposed else "") + (f" g{self.groups}" if self.groups != 1 else ""))

    def tensors(self, device: str | torch.device, dtype: torch.dtype,
                memory_format: torch.memory_format) -> tuple[torch.Tensor, ...]:
        """Random operands for :meth:`call` on ``device``: ``(input, weight, bias)`` for a forward, ``(grad_output,
        input, weight)`` for a backward, the 5-D ones in ``memory_format``."""
        device = torch.device(device)
        g = None if device.type == "meta" else torch.Generator(device=device).manual_seed(0)

        def rand(shape: Shape) -> torch.Tensor:  # drawn where it is used: a 2 GiB operand in milliseconds on a GPU
            t = torch.randn(shape, generator=g, device=device, dtype=dtype)
            return t.contiguous(memory_format=memory_format) if t.dim() == 5 else t

        if self.kind == "forward":
            bias = rand((self.weight[1 if self.transposed else 0] * (self.groups if self.transposed else 1),))
            return rand(self.input), rand(self.weight), bias if self.bias else None  # type: ignore[return-value]
        return rand(self.output), rand(self.input), rand(self.weight)

    def call(self, operands: tuple[torch.Tensor, ...]) -> Any:
        """Run the call on ``operands`` (:meth:`tensors`) as ATen does in the step."""
        common = (list(self.stride), list(self.padding), list(self.dilation), self.transposed,
                  list(self.output_padding), self.groups)
        if self.kind == "forward":
            x, w, b = operands
            return torch.ops.aten.convolution(x, w, b, *common)
        grad, x, w = operands
        bias_sizes = [self.weight[1] * self.groups if self.transposed else self.weight[0]] if self.bias else None
        return torch.ops.aten.convolution_backward(grad, x, w, bias_sizes, *common,
                                                   [self.grads[0], self.grads[1], self.bias])

    @property
    def flop(self) -> float:
        """FLOPs of the call as ``torch.utils.flop_counter`` counts it (the preflight's count of the step)."""
        with torch.device("meta"):
            operands = self.tensors("meta", torch.float32, torch.contiguous_format)
            counter = FlopCounterMode(display=False)
            with counter:
                self.call(operands)
        return float(counter.get_total_flops())


_FORWARD = {torch.ops.aten.convolution.default, torch.ops.aten._convolution.default}


class _ConvRecorder(TorchDispatchMode):
    """Records each convolution call that reaches ATen, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[ConvCall] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func in _FORWARD:
            x, w, b, stride, padding, dilation, transposed, output_padding, groups = args[:9]
            self.calls.append(ConvCall("forward", tuple(x.shape), tuple(w.shape), b is not None, tuple(stride),
                                       tuple(padding), tuple(dilation), bool(transposed), tuple(output_padding),
                                       int(groups)))
        elif func is torch.ops.aten.convolution_backward.default:
            (_, x, w, bias_sizes, stride, padding, dilation, transposed, output_padding, groups, mask) = args[:11]
            self.calls.append(ConvCall("backward", tuple(x.shape), tuple(w.shape), bool(mask[2]), tuple(stride),
                                       tuple(padding), tuple(dilation), bool(transposed), tuple(output_padding),
                                       int(groups), (bool(mask[0]), bool(mask[1]))))
        return func(*args, **kwargs)


def step_convolutions(run: RunSpec) -> tuple[dict[ConvCall, int], StepCost]:
    """Every convolution call of one training step of ``run`` (forward and backward, recomputations included) and
    how many times the step makes it, in the order first made; and the step's cost (its FLOPs) from the same trace:
    the preflight's trace of the step (:func:`~voxdiff.preflight.check.run_step_cost` on a UNet built on meta by
    :func:`~voxdiff.preflight.check.traced_unet`) at the run's batch."""
    recorder = _ConvRecorder()
    with torch.device("meta"):
        model = traced_unet(run)
        with recorder:
            cost = run_step_cost(run, model)
    counts: dict[ConvCall, int] = {}
    for call in recorder.calls:
        counts[call] = counts.get(call, 0) + 1
    return counts, cost


def _timer(device: torch.device) -> Callable[[Callable[[], Any], int], float]:
    """Seconds of ``reps`` runs of a function on ``device`` (CUDA events on a GPU, the wall clock elsewhere)."""
    if device.type == "cuda":
        def cuda(fn: Callable[[], Any], reps: int) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        return cuda

    def wall(fn: Callable[[], Any], reps: int) -> float:
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return time.perf_counter() - t0
    return wall


def time_convolution(call: ConvCall, device: str | torch.device, dtype: torch.dtype, layout: str,
                     autotune: bool = False, warmup: int = 2, reps: int = 5, rounds: int = 3) -> float:
    """Seconds one ``call`` takes on ``device`` in ``dtype`` and ``layout`` (a key of :data:`LAYOUTS`), with
    ``torch.backends.cudnn.benchmark`` set to ``autotune`` (restored after): the median over ``rounds`` of the
    mean over ``reps`` runs, after ``warmup`` runs (the autotuner's trials among them).

    Raises:
        ValueError: an unknown ``layout``, or ``warmup``/``reps``/``rounds`` below what a timing needs.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}: use one of {sorted(LAYOUTS)}")
    if warmup < 1 or reps < 1 or rounds < 1:
        raise ValueError(f"warmup={warmup}, reps={reps}, rounds={rounds}: each must be at least 1 (the first run "
                         "of a shape picks cuDNN's algorithm, and is not timed)")
    device = torch.device(device)
    operands = call.tensors(device, dtype, LAYOUTS[layout])
    before = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = autotune
    try:
        timer = _timer(device)
        timer(lambda: call.call(operands), warmup)
        return statistics.median(timer(lambda: call.call(operands), reps) / reps for _ in range(rounds))
    finally:
        torch.backends.cudnn.benchmark = before
