"""The CPU allocator's allocation and free events, read from ``torch.profiler`` (``profile_memory=True``): the
ground truth the preflight's CPU checks compare with (shared by test_memory.py and test_compiled.py)."""

from __future__ import annotations

from torch._C._profiler import _EventType
from torch.profiler import profile

# Profiler ops that only allocate on behalf of the op that called them.
_ALLOCATING_OPS = {
    "aten::empty", "aten::empty_strided", "aten::empty_like", "aten::new_empty", "aten::new_empty_strided",
    "aten::resize_", "aten::resize_as_",
}  # fmt: skip


def _walk(prof: profile) -> tuple[list, dict[str, int]]:
    """Allocation events in time order, and the start time of every ``record_function`` region by name."""
    allocs, marks = [], {}

    def walk(node):
        if node.tag == _EventType.Allocation:
            allocs.append(node)
        elif node.name not in marks:
            marks[node.name] = node.start_time_ns
        for child in node.children:
            walk(child)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root)
    allocs.sort(key=lambda n: n.start_time_ns)
    return allocs, marks


def allocator_events(prof: profile, old_frees: bool = False) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """``(raw, kept)``: ``(time ns, +bytes | -bytes)`` of every allocation and free in the window, and the same
    without kernel scratch — a block freed before the op that requested it returns (e.g. the im2col buffers of
    ``slow_conv3d``): the tracker follows the storages that ops *return* and does not see scratch by design (on
    CUDA the known scratch buffers are added by explicit rules). Frees of blocks allocated before the window are
    kept when ``old_frees`` (they lower the live bytes), dropped otherwise."""
    allocs, _ = _walk(prof)
    raw, kept, open_blocks = [], [], {}
    for node in allocs:
        size = node.extra_fields.alloc_size
        raw.append((node.start_time_ns, size))
        if size > 0:
            owner = node.parent
            while owner is not None and owner.name in _ALLOCATING_OPS:
                owner = owner.parent
            open_blocks[node.extra_fields.ptr] = (node, owner)
            continue
        hit = open_blocks.pop(node.extra_fields.ptr, None)
        if hit is None:  # a block from before the window
            if old_frees:
                kept.append((node.start_time_ns, size))
            continue
        alloc, owner = hit
        if owner is not None and owner.name.startswith("aten::") and node.start_time_ns <= owner.end_time_ns:
            continue  # scratch: freed inside the op that allocated it
        kept += [(alloc.start_time_ns, alloc.extra_fields.alloc_size), (node.start_time_ns, size)]
    kept += [(a.start_time_ns, a.extra_fields.alloc_size) for a, _ in open_blocks.values()]
    return sorted(raw), sorted(kept)


def peak(events: list[tuple[int, int]]) -> int:
    """Highest running sum of the events (bytes above the start of the window)."""
    cur = best = 0
    for _, d in events:
        cur += d
        best = max(best, cur)
    return best


def phase_peaks(prof: profile, split_at: str) -> tuple[tuple[int, int], tuple[int, int]]:
    """``((peak, end), (peak, end))`` of the live bytes before and from the ``record_function(split_at)`` region
    on, each relative to its phase's start; frees of blocks allocated before the window count."""
    _, marks = _walk(prof)
    _, kept = allocator_events(prof, old_frees=True)
    split = marks[split_at]
    cur = best = 0
    first = None
    start = 0
    for t, d in kept:
        if first is None and t >= split:
            first, start, best = (best, cur), cur, cur
        cur += d
        best = max(best, cur)
    if first is None:
        first, start, best = (best, cur), cur, cur
    return first, (best - start, cur - start)
