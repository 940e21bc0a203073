"""The CUDA caching allocator, as a trace sees it: the live bytes of a traced step, then the segments they take.

All sizes are bytes; GiB means 2**30 bytes.

**Live bytes.** :class:`StorageTracker` is a :class:`~torch.utils._python_dispatch.TorchDispatchMode`: it sees every
ATen op *below* autograd (forward ops, backward ops, optimizer ops), records each output storage it has not seen yet
as an allocation of ``round_up(nbytes, 512)`` bytes (the CUDA caching allocator's ``kMinBlockSize``) and
subtracts it again when a weakref callback reports that the storage died. This is what
``torch.cuda.memory_allocated()`` counts, so the running maximum is the trace's ``max_memory_allocated()``.
A tensor subclass (FSDP's and the sharded EMA's DTensors) is counted by the storages it wraps (a rank's shard), and
``UntypedStorage.resize_`` — how FSDP allocates and frees a unit's gathered weights, outside any ATen op — is
followed while the tracker is active.

On meta, every op whose outputs are fresh tensors runs its (often Python) meta kernel once per input signature and
is replayed from :data:`META_MEMO` afterwards (:class:`MetaMemo`: what the kernel returns, at a fraction of its cost).

A trace cannot see memory that a CUDA kernel allocates inside its own implementation. The rules in
:data:`KERNEL_TEMPORARIES` add those that the CUDA sources of torch 2.13 make explicit; each is held only while
the op runs (it is counted on top of the op's outputs, as the kernel holds it while they exist).

**Segments.** Nor does a trace see the allocator's segments and the CUDA context (the cuBLAS workspaces of each GPU
type: :mod:`voxdiff.run.gpus`). :func:`simulate_reserved` replays the allocation/free sequence of a trace through the
policy of ``c10/cuda/CUDACachingAllocator.cpp`` (torch 2.13, default settings, no memory pressure):

* every request is rounded up to 512 B (``kMinBlockSize``);
* requests <= 1 MiB (``kSmallSize``) come from the small pool, whose segments are 2 MiB (``kSmallBuffer``);
* larger requests come from the large pool: below 10 MiB (``kMinLargeAlloc``) a new segment is 20 MiB
  (``kLargeBuffer``), above it the request rounded up to 2 MiB (``kRoundLarge``);
* a request takes the smallest free cached block that fits (best fit) and splits it when the remainder is
  >= 512 B (small pool) or > 1 MiB (large pool); freed blocks merge with free neighbours of the same segment;
  segments are never returned (``empty_cache`` is not called during training).

The peak of the segment total is what ``torch.cuda.max_memory_reserved()`` would show when memory is
plentiful. Under memory pressure the allocator frees unused cached segments and retries before raising an
out-of-memory error, so reserved memory is an upper estimate, while the verdict (does it fit?) is taken on
allocated memory (see :func:`voxdiff.preflight.memory.predict_step_memory`).
"""

from __future__ import annotations

import math

import bisect
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

from voxdiff.units import GiB, MiB

__all__ = ["BLOCK_BYTES", "CUDA_CONTEXT_BYTES", "KERNEL_TEMPORARIES", "K_LARGE_BUFFER", "K_MIN_LARGE_ALLOC",
           "K_ROUND_LARGE", "K_SMALL_BUFFER", "K_SMALL_SIZE", "META_MEMO", "MetaMemo", "MetaMemoMode", "PhaseStats",
           "StorageTracker", "round_block", "segment_size", "simulate_reserved", "split_pools", "tensors_in"]


BLOCK_BYTES = 512
"""CUDA caching allocator ``kMinBlockSize``: every request is rounded up to a multiple of 512 B."""

aten = torch.ops.aten


def round_block(nbytes: int, granularity: int = BLOCK_BYTES) -> int:
    """Bytes the CUDA caching allocator accounts for a request of ``nbytes`` (0 stays 0)."""
    return -(-nbytes // granularity) * granularity


def _softmax_backward_tmp(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """``softmax_backward_cuda_out`` (aten/src/ATen/native/cuda/SoftMax.cu) runs ``Tensor tmp = grad * output``
    before the reduction: one more score-sized tensor in the promoted dtype of grad and output."""
    grad, output = args[0], args[1]
    dtype = torch.promote_types(grad.dtype, output.dtype)
    return grad.numel() * dtype.itemsize


def _signature(obj: Any) -> Any:
    """Hashable description of arguments: tensors by metadata, sequences recursively, scalars with their type (``2``,
    ``2.0`` and ``True`` are equal in Python but promote differently), the rest as is."""
    if isinstance(obj, torch.Tensor):
        return ("T", tuple(obj.shape), obj.stride(), obj.dtype, obj.storage_offset(), obj.device.type)
    if isinstance(obj, (list, tuple)):
        return tuple(_signature(o) for o in obj)
    if isinstance(obj, dict):
        return tuple((k, _signature(v)) for k, v in sorted(obj.items()))
    if isinstance(obj, (bool, int, float, complex)):
        return (type(obj), obj)
    return obj


_UNMEMOIZABLE = object()
"""The memo's entry for a signature whose outputs a replay would not reproduce (see :class:`MetaMemo`)."""


class MetaMemo:
    """Memoized meta kernels: an op on meta tensors runs once per input signature; afterwards its outputs are new
    empty tensors with the recorded sizes, strides and dtypes.

    On meta an op computes nothing: its outputs' metadata depend only on its inputs' metadata, its non-tensor
    arguments and the default dtype, and many meta kernels are Python decompositions costing hundreds of
    microseconds to milliseconds a call (group norm and its backward, ``linear``/``addmm``, ``linalg_vector_norm``,
    elementwise ops through torch's Python references) — most of a UNet trace's time. A replay is exactly what the
    kernel would return, so traces and their predictions are unchanged. An op is memoized only when all of these
    hold, checked on the call that records it:

    * no other dispatch mode is active below the caller's (its handler would not see the op);
    * its schema mutates no argument and returns no alias (no in-place, ``out=`` or view op);
    * it has a tensor argument, and every tensor argument is a plain tensor on meta (no tensor subclass such as
      FSDP's DTensors, whose own dispatch must run; no CPU tensor, whose values are real);
    * its outputs are plain meta tensors (or None) whose storages are new, distinct from each other and from the
      inputs', start at offset 0 and are exactly as large as their sizes and strides need (what
      ``torch.empty_strided`` makes).

    A signature that fails the last check is remembered as not memoizable. The records are shared by every trace of
    the process (one module-level instance: :data:`META_MEMO`) and cleared when they exceed ``max_entries``.
    ``enabled=False`` runs every kernel (the baseline of ``bench/bench_preflight.py --memo-baseline``).
    """

    def __init__(self, max_entries: int = 200_000, enabled: bool = True) -> None:
        self.max_entries = max_entries
        self.enabled = enabled
        self.records: dict[Any, Any] = {}
        self._functional: dict[Any, bool] = {}
        self.hits = self.misses = 0

    def functional(self, func: Any) -> bool:
        """Whether ``func``'s schema mutates no argument and returns no alias."""
        known = self._functional.get(func)
        if known is None:
            schema = func._schema
            known = (all(r.alias_info is None for r in schema.returns)
                     and not any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments))
            self._functional[func] = known
        return known

    @staticmethod
    def _plain_meta(t: torch.Tensor) -> bool:
        return type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type == "meta"

    def __call__(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``func(*args, **kwargs)``, from the records where it may be. Called from a dispatch mode's handler: where
        another mode is active below it (one entered before it, such as a caller's recorder of every convolution),
        the kernel runs, so that mode sees the op."""
        if not self.enabled or not self.functional(func) or torch._C._len_torch_dispatch_stack():
            return func(*args, **kwargs)
        key = None
        with torch._C.DisableTorchFunction():  # the memo's own reads of metadata: not through the traced world's
            tensors = tensors_in((args, kwargs))  # torch-function modes (the autocast emulator counts every call)
            if tensors and all(self._plain_meta(t) for t in tensors):
                key = (func, _signature(args), _signature(kwargs), torch.get_default_dtype())
                record = self.records.get(key)
                if record is _UNMEMOIZABLE:
                    key = None
                elif record is not None:
                    self.hits += 1
                    return _replay(record)
        if key is None:  # not replayable: the kernel, outside the block above
            return func(*args, **kwargs)
        self.misses += 1
        out = func(*args, **kwargs)  # the kernel as before: its own Python (a decomposition) sees the modes
        with torch._C.DisableTorchFunction():
            if len(self.records) >= self.max_entries:
                self.records.clear()
            self.records[key] = self._record(out, tensors)
        return out

    def _record(self, out: Any, inputs: list[torch.Tensor]) -> Any:
        """The replayable record of ``out``, or :data:`_UNMEMOIZABLE`."""
        seen = {t.untyped_storage()._cdata for t in inputs}

        def record(obj: Any) -> Any:
            if obj is None:
                return None
            if type(obj) in (tuple, list):
                return type(obj), tuple(record(o) for o in obj)
            if not isinstance(obj, torch.Tensor) or not self._plain_meta(obj) or obj.storage_offset() != 0:
                raise _NotReplayable
            st = obj.untyped_storage()
            shape, stride = tuple(obj.shape), obj.stride()
            fresh = torch.empty_strided(shape, stride, dtype=obj.dtype, device="meta")
            if st._cdata in seen or st.nbytes() != fresh.untyped_storage().nbytes():
                raise _NotReplayable
            seen.add(st._cdata)
            return "T", shape, stride, obj.dtype

        try:
            return record(out)
        except _NotReplayable:
            return _UNMEMOIZABLE


class _NotReplayable(Exception):
    """An output a replay would not reproduce (:meth:`MetaMemo._record`)."""


def _replay(record: Any) -> Any:
    """New outputs of a :meth:`MetaMemo._record`: empty meta tensors in the recorded tuples and lists."""
    if record is None:
        return None
    if record[0] == "T":
        return torch.empty_strided(record[1], record[2], dtype=record[3], device="meta")
    kind, items = record
    return kind(_replay(r) for r in items)


def tensors_in(obj: Any, out: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """The tensors in an op's arguments or outputs, in order (tensors in tuples, lists and dicts, as ATen passes
    them): a plain walk, several times cheaper than a pytree's on the traces' hundreds of thousands of ops."""
    if out is None:
        out = []
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            tensors_in(o, out)
    elif isinstance(obj, dict):
        for o in obj.values():
            tensors_in(o, out)
    return out


META_MEMO = MetaMemo()
"""The process's memo of meta kernels (:class:`MetaMemo`), used by every trace on meta."""


class MetaMemoMode(TorchDispatchMode):
    """Runs every op through :data:`META_MEMO`: enter it *first* (at the bottom of the mode stack), so that the
    modes entered after it (a FLOP counter, an operator count) see every op and only the kernel is memoized."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        return META_MEMO(func, args, kwargs or {})


KERNEL_TEMPORARIES: dict[Any, Callable[[tuple[Any, ...], dict[str, Any]], int]] = {
    aten._softmax_backward_data.default: _softmax_backward_tmp,
}
"""ATen op -> bytes the CUDA kernel allocates internally and frees before returning."""


@dataclass
class PhaseStats:
    """Memory of one phase of the traced step; all values in bytes.

    Attributes:
        start: live bytes when the phase began.
        peak: highest live bytes during the phase (what ``max_memory_allocated()`` reports after
            ``reset_peak_memory_stats()`` at the phase start).
        end: live bytes when the phase ended.
    """

    start: int = 0
    peak: int = 0
    end: int = 0


class StorageTracker(TorchDispatchMode):
    """Counts live bytes of storages on ``device_type`` created by ATen ops, with per-phase peaks.

    Args:
        device_type: the device that stands for the GPU (``"meta"`` when tracing without one).
        record_events: keep the allocation/free sequence (for :func:`simulate_reserved`).
        kernel_temporaries: op -> bytes rule for memory a kernel allocates internally; defaults to
            :data:`KERNEL_TEMPORARIES` (CUDA kernels).
        granularity: allocation rounding in bytes (512 for the CUDA caching allocator, 1 to compare with an
            allocator that does not round, such as the CPU one).
    """

    def __init__(
        self,
        device_type: str = "meta",
        record_events: bool = False,
        kernel_temporaries: dict[Any, Callable[[tuple[Any, ...], dict[str, Any]], int]] | None = None,
        granularity: int = BLOCK_BYTES,
    ) -> None:
        super().__init__()
        self.granularity = granularity
        self.device_type = device_type
        self.live = 0
        self.peak = 0
        self.phases: dict[str, PhaseStats] = {}
        self._phase: PhaseStats | None = None
        self._refs: dict[int, tuple[weakref.ref, int, int]] = {}  # id(storage) -> (ref, bytes, key)
        self._next_key = 0
        # allocation/free sequence for the allocator model: (+1 alloc | -1 free, key, bytes)
        self._log: list[tuple[int, int, int]] | None = [] if record_events else None
        #: where each phase began in the event sequence: (phase name, index of its first event)
        self.phase_starts: list[tuple[str, int]] = []
        self._rules = KERNEL_TEMPORARIES if kernel_temporaries is None else kernel_temporaries

    # ----------------------------------------------------------------------------------------- bookkeeping
    @property
    def events(self) -> list[tuple[int, int, int]]:
        """The recorded (sign, key, bytes) sequence (empty unless ``record_events``)."""
        return self._log if self._log is not None else []

    def _bump_peak(self, value: int) -> None:
        if value > self.peak:
            self.peak = value
        if self._phase is not None and value > self._phase.peak:
            self._phase.peak = value

    def _on_free(self, sid: int, _ref: weakref.ref) -> None:
        entry = self._refs.pop(sid, None)
        if entry is None or entry[0] is not _ref:
            if entry is not None:  # a newer storage reused the id; keep it
                self._refs[sid] = entry
            return
        self.live -= entry[1]
        if self._log is not None and entry[1]:  # 0: resized to nothing already (FSDP's free_storage)
            self._log.append((-1, entry[2], entry[1]))

    def track(self, tensor: torch.Tensor) -> None:
        """Count ``tensor``'s storage as allocated (no-op if already counted or not on the device). A tensor
        subclass that wraps others (a DTensor: its local shard) is counted by its inner tensors."""
        if tensor.device.type != self.device_type:
            return
        if is_traceable_wrapper_subclass(tensor):
            for name in tensor.__tensor_flatten__()[0]:
                inner = getattr(tensor, name)
                if isinstance(inner, torch.Tensor):
                    self.track(inner)
            return
        st = tensor.untyped_storage()
        self._count(st, round_block(st.nbytes(), self.granularity), shrink=False)

    def resized(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """Account for ``storage.resize_(nbytes)``, which no ATen op reports: FSDP allocates and frees the
        all-gathered parameters of a unit this way (``alloc_storage`` / ``free_storage``)."""
        self._count(storage, round_block(nbytes, self.granularity), shrink=True)

    def _count(self, storage: torch.UntypedStorage, nbytes: int, shrink: bool) -> None:
        """Count ``storage`` at ``nbytes``: a new allocation, or a known one that grew in place (an ``out=`` op,
        a resize) or, with ``shrink``, became smaller (a resize; 0 frees it until it grows again)."""
        sid = id(storage)
        entry = self._refs.get(sid)
        if entry is None or entry[0]() is not storage:
            if not nbytes:
                return
            key = self._next_key
            self._next_key += 1
            self._refs[sid] = (weakref.ref(storage, lambda r, sid=sid: self._on_free(sid, r)), nbytes, key)
            self.live += nbytes
            if self._log is not None:
                self._log.append((1, key, nbytes))
        else:
            ref, old, key = entry
            if nbytes == old or (nbytes < old and not shrink):
                return
            self.live += nbytes - old
            self._refs[sid] = (ref, nbytes, key)
            if self._log is not None:
                self._log += ([(-1, key, old)] if old else []) + ([(1, key, nbytes)] if nbytes else [])
        self._bump_peak(self.live)

    def __enter__(self) -> StorageTracker:
        original = torch.UntypedStorage.resize_
        tracker = self

        def resize_(storage: torch.UntypedStorage, nbytes: int) -> Any:
            out = original(storage, nbytes)
            if storage.device.type == tracker.device_type:
                tracker.resized(storage, int(nbytes))
            return out

        self._original_resize = original
        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> Any:
        torch.UntypedStorage.resize_ = self._original_resize  # type: ignore[method-assign]
        return super().__exit__(*exc)

    def track_all(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count tensors that exist before tracing starts (parameters, buffers, inputs)."""
        for t in tensors:
            self.track(t)

    def transient(self, nbytes: int) -> None:
        """Account for ``nbytes`` that exist only for an instant (a kernel's internal buffer)."""
        nbytes = round_block(nbytes, self.granularity)
        if nbytes == 0:
            return
        self._bump_peak(self.live + nbytes)
        if self._log is not None:
            key = self._next_key
            self._next_key += 1
            self._log += [(1, key, nbytes), (-1, key, nbytes)]

    # ----------------------------------------------------------------------------------------- phases
    def begin_phase(self, name: str) -> None:
        """Start a phase: its peak starts at the current live bytes."""
        if self._log is not None:
            self.phase_starts.append((name, len(self._log)))
        self._phase = PhaseStats(start=self.live, peak=self.live)
        self.phases[name] = self._phase

    def end_phase(self) -> PhaseStats:
        """End the current phase and return its stats."""
        assert self._phase is not None, "end_phase() without begin_phase()"
        self._phase.end = self.live
        phase, self._phase = self._phase, None
        return phase

    # ----------------------------------------------------------------------------------------- dispatch
    @staticmethod
    def _is_meta_noop(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """In-place ``_foreach_*_`` ops returning nothing, on meta tensors only: they allocate nothing and change
        no metadata, so their (Python) meta kernels can be skipped. They make up most of an optimizer step's
        trace time. Ops touching other devices (AdamW's CPU ``step`` counters) still run."""
        schema = func._schema
        name = schema.name
        if not (name.startswith("aten::_foreach_") and name.endswith("_") and not schema.returns):
            return False
        return all(t.device.type == "meta" for t in tensors_in((args, kwargs)))

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if self.device_type == "meta":
            if self._is_meta_noop(func, args, kwargs):
                return None
            out = META_MEMO(func, args, kwargs)
        else:
            out = func(*args, **kwargs)
        with torch._C.DisableTorchFunction():  # bookkeeping: its reads of metadata skip the torch-function modes
            for t in tensors_in(out):
                self.track(t)
            rule = self._rules.get(func)
            if rule is not None:
                self.transient(rule(args, kwargs))
        return out


K_SMALL_SIZE = 1 * MiB  # largest "small" request
K_SMALL_BUFFER = 2 * MiB  # small-pool segment size
K_LARGE_BUFFER = 20 * MiB  # large-pool segment size for requests below K_MIN_LARGE_ALLOC
K_MIN_LARGE_ALLOC = 10 * MiB
K_ROUND_LARGE = 2 * MiB  # large requests are rounded up to this when a segment is created

CUDA_CONTEXT_BYTES = GiB // 2
"""CUDA context + kernel images, not counted by the caching allocator. PyTorch's CUDA notes ("Memory
management") and NVIDIA's lazy-loading docs put it at roughly 300-600 MB on current drivers with
``CUDA_MODULE_LOADING=LAZY`` (the default since CUDA 11.7 / torch 2.0); 0.5 GiB is the middle of that range."""
DEFAULT_SAFETY_MARGIN = 0.10
"""Head-room asked on top of the predicted peak before a configuration is said to fit. PyTorch's own
``MemTracker`` tests accept +-10 % of ``max_memory_allocated``, and the reference measurements of one
configuration vary by up to 15 % between runs; 10 % covers the former and most of the latter."""


def with_margin(peak_bytes: float, safety_margin: float = DEFAULT_SAFETY_MARGIN) -> int:
    """The bytes a predicted peak needs with the safety margin: ``ceil(peak * (1 + safety_margin))``."""
    return math.ceil(peak_bytes * (1.0 + safety_margin))


def segment_size(nbytes: int) -> int:
    """Size of the segment ``cudaMalloc``'d when no cached block fits a request of ``nbytes``."""
    if nbytes <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if nbytes < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return -(-nbytes // K_ROUND_LARGE) * K_ROUND_LARGE


class _Pool:
    """Free blocks of one pool, ordered by (size, segment, offset) for best-fit search."""

    def __init__(self, small: bool) -> None:
        self.small = small
        self.free: list[tuple[int, int, int]] = []  # (size, segment, offset)

    def take(self, size: int) -> tuple[int, int, int] | None:
        i = bisect.bisect_left(self.free, (size, -1, -1))
        if i == len(self.free):
            return None
        return self.free.pop(i)

    def put(self, block: tuple[int, int, int]) -> None:
        bisect.insort(self.free, block)

    def remove(self, block: tuple[int, int, int]) -> None:
        i = bisect.bisect_left(self.free, block)
        del self.free[i]


def split_pools(events: list[tuple[int, int, int]], phase_starts: list[tuple[str, int]],
                graph_phases: tuple[str, ...]) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
    """Split an allocation/free sequence into two allocator pools: what was allocated during a phase named in
    ``graph_phases`` (a phase ``forward2`` is ``forward`` of step 2) and the rest. With CUDA graphs
    (``torch.compile(mode="reduce-overhead")``) the graphs' warm-up, recording and replays allocate from a private
    pool of the caching allocator whose segments the rest of the process never uses, nor the graphs the rest's
    (PyTorch's ``cudagraph_trees``); each pool's segments are then :func:`simulate_reserved` of its own events.

    Args:
        events: ``(+1 | -1, key, bytes)`` as :attr:`StorageTracker.events`; a free goes with its allocation.
        phase_starts: ``(phase name, index of its first event)`` in order (:attr:`StorageTracker.phase_starts`);
            events before the first phase are outside every phase.
        graph_phases: the phase names, without their step number, whose allocations go to the first pool.

    Returns:
        ``(graph_events, other_events)``.
    """
    starts = [i for _, i in phase_starts]
    names = [n.rstrip("0123456789") for n, _ in phase_starts]
    graph: list[tuple[int, int, int]] = []
    other: list[tuple[int, int, int]] = []
    in_graph: dict[int, bool] = {}
    for i, (sign, key, size) in enumerate(events):
        if sign > 0:
            at = bisect.bisect_right(starts, i) - 1
            in_graph[key] = at >= 0 and names[at] in graph_phases
        (graph if in_graph.get(key, False) else other).append((sign, key, size))
    return graph, other


def simulate_reserved(events: list[tuple[int, int, int]]) -> tuple[int, int]:
    """Replay an allocation/free sequence through the caching allocator's default policy.

    Args:
        events: ``(+1, key, bytes)`` for an allocation and ``(-1, key, bytes)`` for its free, in order;
            bytes already rounded to 512.

    Returns:
        ``(peak_reserved, peak_allocated)`` in bytes: the largest total of segments, and the largest total
        of allocated *blocks* (a block can be larger than its request when the remainder was too small to
        split, which ``max_memory_allocated`` also counts).
    """
    pools = {True: _Pool(small=True), False: _Pool(small=False)}
    # segment -> pool flag; block maps: (segment, offset) -> [size, is_free]; ends: (segment, end) -> offset
    seg_small: list[bool] = []
    blocks: dict[tuple[int, int], list[int]] = {}
    ends: dict[tuple[int, int], int] = {}
    where: dict[int, tuple[int, int, int]] = {}  # key -> (segment, offset, block size)
    reserved = allocated = peak_reserved = peak_allocated = 0

    for sign, key, size in events:
        if sign > 0:
            small = size <= K_SMALL_SIZE
            pool = pools[small]
            found = pool.take(size)
            if found is None:
                seg_bytes = segment_size(size)
                seg = len(seg_small)
                seg_small.append(small)
                reserved += seg_bytes
                peak_reserved = max(peak_reserved, reserved)
                bsize, off = seg_bytes, 0
                blocks[(seg, 0)] = [seg_bytes, 1]
                ends[(seg, seg_bytes)] = 0
            else:
                bsize, seg, off = found
            rest = bsize - size
            split = rest >= BLOCK_BYTES if small else rest > K_SMALL_SIZE
            if split:
                blocks[(seg, off)] = [size, 0]
                del ends[(seg, off + bsize)]
                ends[(seg, off + size)] = off
                blocks[(seg, off + size)] = [rest, 1]
                ends[(seg, off + bsize)] = off + size
                pool.put((rest, seg, off + size))
                bsize = size
            else:
                blocks[(seg, off)][1] = 0
            where[key] = (seg, off, bsize)
            allocated += bsize
            peak_allocated = max(peak_allocated, allocated)
        else:
            seg, off, bsize = where.pop(key)
            allocated -= bsize
            pool = pools[seg_small[seg]]
            # merge with the next block
            nxt = blocks.get((seg, off + bsize))
            if nxt is not None and nxt[1]:
                pool.remove((nxt[0], seg, off + bsize))
                del blocks[(seg, off + bsize)]
                del ends[(seg, off + bsize)]
                bsize += nxt[0]
            # merge with the previous block
            prev_off = ends.get((seg, off))
            if prev_off is not None and blocks[(seg, prev_off)][1]:
                psize = blocks[(seg, prev_off)][0]
                pool.remove((psize, seg, prev_off))
                del blocks[(seg, off)]
                del ends[(seg, off)]
                off, bsize = prev_off, psize + bsize
            blocks[(seg, off)] = [bsize, 1]
            ends[(seg, off + bsize)] = off
            pool.put((bsize, seg, off))
    return peak_reserved, peak_allocated
