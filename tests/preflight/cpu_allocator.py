"""The CPU allocator's peak from a ``torch.profiler`` trace (``profile_memory=True``): the measurement the
preflight's tracker is checked against (``test_memory.py``: one process; ``test_distributed_memory.py``: each
rank of a gloo run; ``test_compiled.py``: the phases of a compiled step)."""

from __future__ import annotations

from torch._C._profiler import _EventType
from torch.profiler import profile

# Profiler ops that only allocate on behalf of the op that called them.
_ALLOCATING_OPS = {
    "aten::empty", "aten::empty_strided", "aten::empty_like", "aten::new_empty", "aten::new_empty_strided",
    "aten::resize_", "aten::resize_as_",
}  # fmt: skip
#: allocations inside these belong to the communication library (gloo's staging buffers, on its worker threads or
#: kept by its last work item): a GPU run's NCCL reduces into the caller's tensors instead. c10d's coalesced
#: broadcast (DDP's broadcast of the initial weights) flattens what it sends with aten::flatten_dense_tensors on the
#: caller's thread; gloo's worker thread frees that buffer only when it takes its next work item, which on a loaded
#: machine came after the measured steps in 1 of 25 ranks (+2.93 MB, the weights of test_distributed_memory's UNet)
_COMMUNICATION = ("gloo:", "c10d::", "aten::flatten_dense_tensors")


def _inside_communication(node) -> bool:
    while node is not None:
        if node.name.startswith(_COMMUNICATION):
            return True
        node = node.parent
    return False


def _walk(prof: profile) -> tuple[list, dict[str, tuple[int, int]]]:
    """Allocation events in time order, and ``(start, end)`` ns of the first ``record_function`` region of each
    name."""
    allocs, marks = [], {}

    def walk(node):
        if node.tag == _EventType.Allocation:
            allocs.append(node)
        elif node.name not in marks:
            marks[node.name] = (node.start_time_ns, node.end_time_ns)
        for child in node.children:
            walk(child)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root)
    allocs.sort(key=lambda n: n.start_time_ns)
    return allocs, marks


def allocator_events(prof: profile, old_frees: bool = False) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """``(raw, kept)``: ``(time ns, +bytes | -bytes)`` of every allocation and free in the profile, and the same
    without kernel scratch and communication buffers, in time order.

    Kernel scratch is a block freed before the ATen op that requested it returns (e.g. the im2col buffers of
    ``slow_conv3d``): the tracker follows the storages that ops *return* and does not see scratch by design (on
    CUDA the known scratch buffers are added by explicit rules). Communication buffers: see :data:`_COMMUNICATION`.
    Frees of blocks allocated before the profile are kept in both when ``old_frees`` (they lower the live bytes),
    dropped from both otherwise (the allocator reports such a free when an earlier profiler saw the block allocated:
    garbage of an earlier test, collected during this profile).
    """
    allocs, _ = _walk(prof)
    raw, kept, open_blocks, communication, profiled = [], [], {}, set(), set()
    for node in allocs:
        size, ptr = node.extra_fields.alloc_size, node.extra_fields.ptr
        if size > 0:
            profiled.add(ptr)
        if size > 0 or ptr in profiled or old_frees:
            raw.append((node.start_time_ns, size))
        if size < 0:
            profiled.discard(ptr)
        if size > 0:
            if _inside_communication(node.parent):
                communication.add(ptr)
                continue
            owner = node.parent  # the dispatcher op that asked for the block (not a record_function region)
            while owner is not None and (owner.name in _ALLOCATING_OPS or "::" not in owner.name):
                owner = owner.parent
            open_blocks[ptr] = (node, owner)
            continue
        hit = open_blocks.pop(ptr, None)
        if hit is None:  # a block from before the profile, or a communication buffer
            if old_frees and ptr not in communication:
                kept.append((node.start_time_ns, size))
            communication.discard(ptr)
            continue
        alloc, owner = hit
        if owner is not None and owner.name.startswith("aten::") and node.start_time_ns <= owner.end_time_ns:
            continue  # scratch: freed inside the ATen op that allocated it (not inside a compiled graph's call)
        kept += [(alloc.start_time_ns, alloc.extra_fields.alloc_size), (node.start_time_ns, size)]
    kept += [(a.start_time_ns, a.extra_fields.alloc_size) for a, _ in open_blocks.values()]
    return sorted(raw, key=lambda e: e[0]), sorted(kept, key=lambda e: e[0])


def profiler_peaks(prof: profile, window: str | None = None) -> tuple[int, int]:
    """Running peak of the CPU allocator's allocation/free events (bytes above the start of the profile).

    Returns ``(peak of all allocations, peak without kernel scratch and communication buffers)``
    (:func:`allocator_events`).

    Args:
        prof: the profile.
        window: the name of a ``record_function`` region: the peak is taken inside it only (blocks allocated
            before it and still alive count).
    """
    _, marks = _walk(prof)
    if window is not None and window not in marks:
        raise ValueError(f"no record_function({window!r}) region in the profile")
    start, end = marks[window] if window is not None else (None, None)
    raw, kept = allocator_events(prof)

    def peak(events):
        cur = best = 0
        for t, d in events:
            cur += d
            if start is None or start <= t <= end:
                best = max(best, cur)
        return best

    return peak(raw), peak(kept)


def phase_peaks(prof: profile, split_at: str) -> tuple[tuple[int, int], tuple[int, int]]:
    """``((peak, end), (peak, end))`` of the live bytes (without scratch) before and from the
    ``record_function(split_at)`` region on, each relative to its phase's start; frees of blocks allocated before
    the profile count."""
    _, marks = _walk(prof)
    _, kept = allocator_events(prof, old_frees=True)
    split = marks[split_at][0]
    cur = best = start = 0
    first = None
    for t, d in kept:
        if first is None and t >= split:
            first, start, best = (best, cur), cur, cur
        cur += d
        best = max(best, cur)
    if first is None:
        first, start, best = (best, cur), cur, cur
    return first, (best - start, cur - start)
