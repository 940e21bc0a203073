"""Running out of memory after the preflight said the run fits: one message, the last good checkpoint, a record.

The preflight predicts the peaks of training, validation and sampling before anything is built and refuses a run
that does not fit (``EXIT_NO_FIT``). A run can still run out of memory, hours in, at its first validation or
sampling: where the prediction misses by more than its safety margin (its errors where measured: README,
"Preflight"), where another process holds part of the GPU, or where the caching allocator fragments. Then every
command exits :data:`~voxdiff.cli.exit_codes.EXIT_MEMORY` with one line (:func:`is_out_of_memory` in
:func:`~voxdiff.cli.exit_codes.refusals`), and ``train.py`` says more (:func:`memory_stop`):

* the phase (training, validation, its sanity check, sampling), the global step and the batch;
* what PyTorch's allocator reported (:func:`parse_allocator_message`: the request, the device's capacity and free
  memory, what PyTorch had allocated and reserved, the memory of the process and of others) beside the preflight's
  prediction for the run, and by how much the need measured exceeds it;
* the last good checkpoint (Lightning writes none on an exception: nothing after it is lost but the steps since);
* the fix, worked out from what was measured:

  - the need exceeds the prediction by more than the margin: resume with ``+preflight.safety_margin=M``, the
    margin that covers the miss measured here (``M = miss x (1 + margin) - 1``, rounded up to 0.05). With it the
    preflight's check at start, before anything is built, refuses a configuration that would not fit (where the
    device's memory was the limit, this one) and lists the changes it predicts to fit (``data.batch_size=auto``
    chooses within it);
  - within the margin, and other processes held part of the device: a device of its own, or
    ``+preflight.gpu_memory_gib=`` what they leave;
  - within the margin, and PyTorch held memory reserved but unallocated: the allocator's expandable segments
    (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``);
  - and always, where they apply, half the batch (``+preflight.effective_batch`` keeps the optimisation's) or
    gradient checkpointing.

``train.py`` writes the figures to ``<run dir>/memory_error.json`` (atomically; ``memory_error.rank<r>.json`` on
rank r > 0): with the config, they are what a report of the preflight's miss needs.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from voxdiff.files import atomic_write
from voxdiff.units import GiB, memory_size

__all__ = ["AllocatorState", "MemoryStop", "Predicted", "is_out_of_memory", "memory_stop", "one_line",
           "parse_allocator_message", "write_record"]

#: the phrase of the CPU allocator's failure (a RuntimeError, not torch.OutOfMemoryError)
CPU_ALLOCATOR_FAILURE = "DefaultCPUAllocator: can't allocate memory"

_SIZE = r"(\d+(?:\.\d+)?) (bytes|KiB|MiB|GiB|TiB)"
_UNITS = {"bytes": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}

#: memory of other processes on the device below which it is not named as a cause (the CUDA context of a process
#: that only looks at the GPU, a monitoring agent)
OTHERS_NOTED_BYTES = GiB

#: reserved-but-unallocated memory above which fragmentation is named as a cause, as a share of the device
FRAGMENTED_SHARE = 0.05


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is an allocator's failure: ``torch.OutOfMemoryError`` (CUDA, and other accelerators), or the
    CPU allocator's ``RuntimeError``. Checked by name and message, so that ``python -m voxdiff.cli.exit_codes``
    need not import torch."""
    return any(t.__name__ == "OutOfMemoryError" for t in type(exc).__mro__) or CPU_ALLOCATOR_FAILURE in str(exc)


@dataclass(frozen=True)
class AllocatorState:
    """What an allocator's out-of-memory message says, in bytes (None: not in the message).

    Attributes:
        device: ``cuda`` (PyTorch's CUDA caching allocator) or ``cpu`` (the default CPU allocator).
        requested: the allocation that failed.
        capacity: the device's memory; free: what was free on it.
        allocated: what PyTorch's tensors held (CUDA graphs' private pools included).
        unallocated: what PyTorch held reserved beside them (cached, fragmented).
        this_process: the failing process's device memory, its CUDA context included (when the driver says).
        others: the device memory other processes held (each one the driver names, summed).
    """

    device: str
    requested: int | None = None
    capacity: int | None = None
    free: int | None = None
    allocated: int | None = None
    unallocated: int | None = None
    this_process: int | None = None
    others: int | None = None

    @property
    def needed_at_least(self) -> int | None:
        """What the run's tensors needed at the failure, at least: those alive, and the one that failed."""
        if self.allocated is None or self.requested is None:
            return None
        return self.allocated + self.requested


def _bytes(number: str, unit: str) -> int:
    return int(float(number) * _UNITS[unit])


def parse_allocator_message(message: str) -> AllocatorState:
    """The figures of an out-of-memory message (the CUDA caching allocator's since PyTorch 2.1, its older form, or
    the CPU allocator's). Any figure the message lacks is None."""
    text = " ".join(message.split())
    if CPU_ALLOCATOR_FAILURE in text:
        found = re.search(r"you tried to allocate (\d+) bytes", text)
        return AllocatorState("cpu", requested=int(found.group(1)) if found else None)

    def size(*patterns: str) -> int | None:  # the first pattern found (0 bytes is a figure, not a miss)
        for pattern in patterns:
            found = re.search(pattern, text)
            if found:
                return _bytes(found.group(1), found.group(2))
        return None

    others = [_bytes(n, u) for n, u in re.findall(rf"Process \d+ has {_SIZE} memory in use", text)]
    return AllocatorState(
        "cuda",
        requested=size(rf"Tried to allocate {_SIZE}"),
        capacity=size(rf"total capacity of {_SIZE}", rf"{_SIZE} total capacity"),
        free=size(rf"of which {_SIZE} is free", rf"{_SIZE} free;"),
        allocated=size(rf"{_SIZE} is allocated by PyTorch", rf"{_SIZE} already allocated"),
        unallocated=size(rf"and {_SIZE} is reserved by PyTorch but unallocated"),
        this_process=size(rf"this process has {_SIZE} memory in use"),
        # the driver names processes it can see (in a container, often only this one, under its host pid)
        others=sum(others) if others else None,
    )


@dataclass(frozen=True)
class Predicted:
    """The preflight's verdict on the run, as :func:`memory_stop` compares with (GiB).

    Attributes:
        peak_gib: the predicted per-GPU peak the verdict is on (with CUDA graphs, their pool beside validation).
        peak_phase: the phase that sets it.
        need_gib: ``peak * (1 + margin) +`` the CUDA context; budget_gib: what it was checked against.
        margin: the safety margin.
        phases_gib: each phase's predicted allocated peak (training, validation, sampling), where predicted.
        graph_pool_gib: the CUDA graphs' pool kept beside validation and sampling (0 without them).
        budget_source: where ``budget_gib`` came from (``preflight.gpu_memory_gib``, ``local GPU H100``, ...).
    """

    peak_gib: float
    peak_phase: str
    need_gib: float
    budget_gib: float
    margin: float
    phases_gib: dict[str, float] = field(default_factory=dict)
    graph_pool_gib: float = 0.0
    budget_source: str = ""

    @classmethod
    def of(cls, verdict: Any) -> Predicted | None:
        """From a :class:`~voxdiff.preflight.check.PreflightResult` (None: the run was not predicted)."""
        if verdict is None or verdict.report is None:
            return None
        figures = verdict.predicted_phases_gib()
        return cls(float(verdict.per_gpu_peak_gib), str(verdict.peak_phase), float(verdict.need_gib),
                   float(verdict.budget_gib), float(verdict.margin),
                   {p: figures[p] for p in ("training", "validation", "sampling") if p in figures},
                   figures.get("graph_pool", 0.0), str(verdict.budget_source))


class MemoryStop(Exception):
    """``train.py`` ran out of memory (:data:`~voxdiff.cli.exit_codes.EXIT_MEMORY`); the message is the report
    :func:`memory_stop` made, ``record`` its figures (written by :func:`write_record`)."""

    def __init__(self, message: str, record: dict[str, Any]) -> None:
        super().__init__(message)
        self.record = record


def _gib(n: float | None) -> str:
    return "?" if n is None else memory_size(int(n))


def one_line(exc: BaseException) -> str:
    """An allocator failure in one line, for any command: what it tried to allocate against what the device had,
    and the fix that does not depend on the command's phase."""
    state = parse_allocator_message(str(exc))
    if state.device == "cpu":
        return (f"the host's memory could not hold {_gib(state.requested)} more. Fix: a smaller batch size "
                "(train.py: data.batch_size; sample.py, evaluate.py: batch_size), or a machine with more memory")
    held = (f"; other processes held {_gib(state.others)}" if state.others and state.others >= OTHERS_NOTED_BYTES
            else "")
    return (f"CUDA out of memory: tried to allocate {_gib(state.requested)} with {_gib(state.free)} free of "
            f"{_gib(state.capacity)} (PyTorch had {_gib(state.allocated)} allocated){held}. Fix: a smaller batch "
            "size (train.py: data.batch_size; sample.py, evaluate.py: batch_size), or a GPU of its own or with more "
            "memory")


def _round_up(x: float, step: float = 0.05) -> float:
    return math.ceil(round(x / step, 6)) * step


def memory_stop(exc: BaseException, *, phase: str, step: int, epoch: int, batch_size: int,
                checkpointing: str | None, predicted: Predicted | None, last_checkpoint: str | None,
                measured: dict[str, int] | None = None) -> MemoryStop:
    """The report of ``train.py`` running out of memory (see the module docstring).

    Args:
        exc: the allocator's error.
        phase: ``training``, ``validation``, ``sanity check`` (Lightning's validation before training) or
            ``sampling``.
        step, epoch: ``trainer.global_step`` (optimizer steps done) and ``trainer.current_epoch``.
        batch_size: ``data.batch_size``; checkpointing: ``model.gradient_checkpointing`` (None: a VQ-VAE's run).
        predicted: the preflight's verdict on the run (None: not predicted, a stage 1).
        last_checkpoint: the newest checkpoint on disk (None: none written yet).
        measured: ``torch.cuda`` statistics read after the failure (``max_memory_allocated``,
            ``max_memory_reserved``), recorded beside the message's.
    """
    state = parse_allocator_message(str(exc))
    needed = state.needed_at_least
    if needed is None and state.requested is not None and measured and "max_memory_allocated" in measured:
        needed = measured["max_memory_allocated"] + state.requested  # no allocated figure: the peak so far
    where = f"{phase} at global step {step} (epoch {epoch}, batch {batch_size})"
    device = "CUDA" if state.device == "cuda" else "host"
    parts = [f"{device} out of memory in {where}"]
    miss = None
    fixes: list[str] = []
    if needed is not None:
        held = (f"{_gib(state.allocated)} allocated + {_gib(state.requested)} requested"
                if state.allocated is not None else f"a peak of {_gib(needed - state.requested)} so far + "
                                                    f"{_gib(state.requested)} requested")
        parts[0] += f": PyTorch needed at least {_gib(needed)} ({held})"
    if predicted is not None:
        phase_peak = predicted.phases_gib.get("validation" if phase == "sanity check" else phase)
        parts.append(f"the preflight predicted a peak of {predicted.peak_gib:.2f} GiB for the run (set by "
                     f"{predicted.peak_phase}; {predicted.need_gib:.1f} GiB needed with its {predicted.margin:.0%} "
                     f"margin and the CUDA context, of {predicted.budget_gib:.1f} GiB)"
                     + (f", {phase_peak:.2f} GiB allocated in {phase}" if phase_peak is not None else "")
                     + (f" beside the CUDA graphs' pool of {predicted.graph_pool_gib:.2f} GiB"
                        if predicted.graph_pool_gib and phase != "training" else ""))
        if needed is not None and predicted.peak_gib > 0 and needed / GiB < predicted.peak_gib:
            # the allocator's figure is where the run failed: a lower bound of its need, which cannot show a miss
            parts.append(f"it failed below the predicted peak, so {_gib(needed)} is a lower bound of the run's need, "
                         "not a miss of the prediction")
            if state.capacity is not None and predicted.need_gib > state.capacity / GiB:
                parts.append(f"the prediction needs {predicted.need_gib:.1f} GiB, more than this GPU's "
                             f"{_gib(state.capacity)}: the check at start passed against a budget of "
                             f"{predicted.budget_gib:.1f} GiB ({predicted.budget_source or 'its GPU type'})")
                hold = (f"the check then holds the run to this GPU's {_gib(state.capacity)} and lists the changes it "
                        "predicts to fit")
                fixes.append(f"resume with ckpt_path=auto without +preflight.gpu_memory_gib: {hold}"
                             if predicted.budget_source == "preflight.gpu_memory_gib" else
                             f"resume with ckpt_path=auto +preflight.gpu_memory_gib="
                             f"{math.floor(state.capacity / GiB * 10) / 10:.1f}: {hold}")
        elif needed is not None and predicted.peak_gib > 0:
            miss = needed / GiB / predicted.peak_gib
            beyond = miss > 1 + predicted.margin
            parts.append(f"the need measured is {miss - 1:+.0%} of the prediction, "
                         + ("beyond its margin" if beyond else "within its margin"))
            if beyond:
                margin = _round_up(miss * (1 + predicted.margin) - 1)
                fixes.append(f"resume with ckpt_path=auto +preflight.safety_margin={margin:.2f}: the margin that "
                             "covers the miss measured here, with which the preflight's check at start refuses a "
                             "configuration that would not fit and lists the changes it predicts to fit "
                             "(data.batch_size=auto chooses within it)")
    if state.others is not None and state.others >= OTHERS_NOTED_BYTES:
        parts.append(f"other processes held {_gib(state.others)} of the device")
        if state.capacity is not None:
            left = (state.capacity - state.others) / GiB
            fixes.append(f"give the run a GPU of its own, or budget for what the others leave: resume with "
                         f"ckpt_path=auto +preflight.gpu_memory_gib={math.floor(left * 10) / 10:.1f}")
    if (state.unallocated is not None and state.capacity
            and state.unallocated >= FRAGMENTED_SHARE * state.capacity):
        parts.append(f"PyTorch held {_gib(state.unallocated)} reserved but unallocated (fragmented)")
        fixes.append("resume with ckpt_path=auto and PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True in the "
                     "environment")
    if batch_size > 1:
        fixes.append(f"resume with ckpt_path=auto data.batch_size={batch_size // 2} (with "
                     f"+preflight.effective_batch={batch_size} the optimizer still averages {batch_size} samples a "
                     "step, by gradient accumulation)")
    if checkpointing == "none":
        fixes.append("resume with ckpt_path=auto model.gradient_checkpointing=block")
    parts.append("the last good checkpoint: " + (f"{last_checkpoint} (nothing was written after it)"
                                                  if last_checkpoint else "none was written yet"))
    message = "; ".join(parts) + (". Fix: " + "; or ".join(fixes) if fixes else "")
    record = {
        "phase": phase, "global_step": step, "epoch": epoch, "batch_size": batch_size,
        "gradient_checkpointing": checkpointing,
        "allocator": asdict(state), "needed_at_least_bytes": needed, "measured_after": measured or {},
        "predicted": asdict(predicted) if predicted is not None else None,
        "miss": miss, "last_checkpoint": last_checkpoint, "fixes": fixes,
        "error": " ".join(str(exc).split())[:2000],
    }
    return MemoryStop(message, record)


def write_record(stop: MemoryStop, run_dir: Path, rank: int = 0) -> Path:
    """``memory_error.json`` (``memory_error.rank<r>.json`` on rank r > 0) in ``run_dir``, written atomically."""
    path = Path(run_dir) / ("memory_error.json" if rank == 0 else f"memory_error.rank{rank}.json")
    text = json.dumps(stop.record, indent=1, default=str) + "\n"
    return atomic_write(path, lambda f: f.write(text.encode()))

