"""``torch.compile`` of the training forward (``model.compile``): compiled once, never a silent fallback.

Only the forward of the training loss runs compiled: :class:`CompiledForward` holds ``torch.compile(model)``, a
separate object that shares the model's parameters, while the model itself stays the eager module. So

* checkpoints keep the model's own keys (``model.*``, never ``_orig_mod.``): the compiled wrapper is not a
  sub-module of anything that is saved;
* validation, sampling and the EMA swap call the eager module and never trigger a recompilation (the EMA copies
  weights in place: the compiled graph reads the same parameters);
* the batch shape is fixed (``dynamic=False``): nothing is marked dynamic. The training loader leaves out each
  epoch's last, smaller batch on a GPU (``data.drop_last``, :func:`voxdiff.data.split.check_drop_last`); where it
  does not, that batch compiles a second graph once (and, with CUDA graphs, records a second one).

The first training step compiles (minutes on a GPU): it is a phase of its own, logged before
("compiling the training step ...") and after ("... compiled in X s"). A failure of dynamo, AOTAutograd or the
backend, in the forward or in the (lazily compiled) backward, becomes a :class:`CompileFailed` — a
:class:`~voxdiff.errors.ConfigError` that names ``model.compile=false`` — instead of a traceback or a silent eager
fallback (``torch._dynamo.config.suppress_errors`` stays off).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from voxdiff.errors import ConfigError, show_value
from voxdiff.models.unet import CUDAGRAPH_MODES

log = logging.getLogger(__name__)

#: modules whose exceptions are failures of compiling, not of the model
_COMPILER_MODULES = ("torch._dynamo", "torch._inductor", "torch._functorch", "torch._subclasses", "triton")


@dataclass(frozen=True)
class CompileSettings:
    """How the training forward is compiled (``model.compile_mode``, ``model.compile_backend``).

    Attributes:
        mode: ``torch.compile(mode=...)``; None: torch's default.
        backend: ``torch.compile(backend=...)``: ``inductor``, or ``aot_eager`` to tell a dynamo/autograd problem
            from an inductor one.
        configured: ``model.compile`` as configured (``true``, or ``auto`` resolved on a GPU), for messages.
        channels_last: ``model.channels_last``: inductor lays out every tensor of the graph that feeds or leaves a
            convolution channels-last (its ``force_layout_optimization``; by itself it skips a UNet's graph).
    """

    mode: str | None = None
    backend: str = "inductor"
    configured: bool | str = True
    channels_last: bool = False

    def describe(self) -> str:
        return (f"model.compile={show_value(self.configured)}, mode {self.mode or 'default'}, "
                f"backend {self.backend}" + (", channels-last" if self.channels_last else ""))

    def compile_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of ``torch.compile`` besides the model: ``mode``, or, for a channels-last inductor
        graph, the mode's inductor options plus ``force_layout_optimization`` (``torch.compile`` takes a mode or
        options, not both)."""
        if self.channels_last and self.backend == "inductor":
            import torch._inductor  # imported only for a channels-last run

            return {"options": {**torch._inductor.list_mode_options(self.mode or "default"),
                                "force_layout_optimization": True}}
        return {"mode": self.mode} if self.mode is not None else {}


class CompileFailed(ConfigError):
    """``torch.compile`` of the training forward failed; the run stops and says how to run without it."""

    def __init__(self, settings: CompileSettings, error: BaseException) -> None:
        first = (str(error).strip().splitlines() or [""])[0][:300]
        log.error("torch.compile of the training step failed (%s)", settings.describe(), exc_info=error)
        super().__init__(
            "model.compile", settings.configured,
            f"torch.compile of the training step failed ({settings.describe()}): {type(error).__name__}: {first} "
            "(the compiler's full error is in the log)",
            "set model.compile=false to train the same step eagerly (slower, same results)")


def is_compile_error(error: BaseException) -> bool:
    """Whether ``error`` comes from the compiler stack (dynamo, AOTAutograd, inductor, Triton)."""
    return any(type(error).__module__.startswith(m) for m in _COMPILER_MODULES)


class CompiledForward:
    """``torch.compile(model)`` for the training forward, with its warm-up timed and its failures named.

    Args:
        model: the eager module; it stays what it is (its ``state_dict`` keys do not change).
        settings: mode and backend.

    Attributes:
        module: the compiled callable (shares ``model``'s parameters and buffers).
        seconds: the wall time of the warm-up (the first step: compiling forward and backward, and running it),
            once it has finished; None before.
    """

    def __init__(self, model: nn.Module, settings: CompileSettings) -> None:
        self.settings = settings
        self.module = torch.compile(model, backend=settings.backend, dynamic=False, **settings.compile_kwargs())
        self.seconds: float | None = None
        self._started: float | None = None

    @property
    def warming_up(self) -> bool:
        """Whether the first step has started and not finished yet."""
        return self._started is not None and self.seconds is None

    @contextmanager
    def errors(self) -> Iterator[None]:
        """Run compiled code: the compiler's exceptions become :class:`CompileFailed`."""
        try:
            yield
        except Exception as err:
            if is_compile_error(err):
                raise CompileFailed(self.settings, err) from err
            raise

    @property
    def cudagraphs(self) -> bool:
        """Whether the mode captures CUDA graphs (replayed from the third step on a GPU; ignored on a CPU)."""
        return self.settings.mode in CUDAGRAPH_MODES

    def start(self) -> None:
        """Called before each training forward: the first call opens the warm-up phase. With CUDA graphs, each call
        also starts a new iteration of the graph trees, so the outputs of the previous step's replay (which the
        next replay overwrites) are known to be dead rather than re-recorded as a new graph."""
        if self.cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()
        if self._started is None:
            self._started = time.perf_counter()
            log.info("compiling the training step (%s): the first step takes longer", self.settings.describe())

    def finish(self) -> float | None:
        """Called after each optimizer step: the first call closes the warm-up phase and returns its seconds."""
        if not self.warming_up:
            return None
        self.seconds = time.perf_counter() - self._started  # type: ignore[operator]
        log.info("compiled the training step in %.1f s (the first step included; %s)", self.seconds,
                 self.settings.describe())
        return self.seconds
