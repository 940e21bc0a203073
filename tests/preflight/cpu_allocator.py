"""The CPU allocator's peak from a ``torch.profiler`` trace (``profile_memory=True``): the measurement the
preflight's tracker is checked against (``test_memory.py``: one process; ``test_distributed_memory.py``: each
rank of a gloo run)."""

from __future__ import annotations

from torch._C._profiler import _EventType
from torch.profiler import profile

# Profiler ops that only allocate on behalf of the op that called them.
_ALLOCATING_OPS = {
    "aten::empty", "aten::empty_strided", "aten::empty_like", "aten::new_empty", "aten::new_empty_strided",
    "aten::resize_", "aten::resize_as_",
}  # fmt: skip
#: allocations inside these belong to the communication library (gloo's staging buffers, on its worker threads or
#: kept by its last work item): a GPU run's NCCL reduces into the caller's tensors instead
_COMMUNICATION = ("gloo:", "c10d::")


def _inside_communication(node) -> bool:
    while node is not None:
        if node.name.startswith(_COMMUNICATION):
            return True
        node = node.parent
    return False


def profiler_peaks(prof: profile, window: str | None = None) -> tuple[int, int]:
    """Running peak of the CPU allocator's allocation/free events (bytes above the start of the profile).

    Returns ``(peak of all allocations, peak without kernel scratch and communication buffers)``. Kernel scratch
    is a block freed before the ATen op that requested it returns (e.g. the im2col buffers of ``slow_conv3d``):
    the tracker follows the storages that ops *return* and does not see scratch by design (on CUDA the known
    scratch buffers are added by explicit rules). Communication buffers: see :data:`_COMMUNICATION`.

    Args:
        prof: the profile.
        window: the name of a ``record_function`` region: the peak is taken inside it only (blocks allocated
            before it and still alive count).
    """
    allocs, marks = [], []

    def walk(node):
        if node.tag == _EventType.Allocation:
            allocs.append(node)
        elif window is not None and node.name == window:
            marks.append(node)
        for child in node.children:
            walk(child)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root)
    if window is not None and not marks:
        raise ValueError(f"no record_function({window!r}) region in the profile")
    start, end = (marks[0].start_time_ns, marks[0].end_time_ns) if marks else (None, None)
    allocs.sort(key=lambda n: n.start_time_ns)
    raw, kept, open_blocks, communication = [], [], {}, set()
    for node in allocs:
        size, ptr = node.extra_fields.alloc_size, node.extra_fields.ptr
        raw.append((node.start_time_ns, size))
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
            communication.discard(ptr)
            continue
        alloc, owner = hit
        if owner is not None and node.start_time_ns <= owner.end_time_ns:
            continue  # scratch: freed inside the op that allocated it
        kept += [(alloc.start_time_ns, alloc.extra_fields.alloc_size), (node.start_time_ns, size)]
    kept += [(a.start_time_ns, a.extra_fields.alloc_size) for a, _ in open_blocks.values()]

    def peak(events):
        cur = best = 0
        for t, d in sorted(events, key=lambda e: e[0]):
            cur += d
            if start is None or start <= t <= end:
                best = max(best, cur)
        return best

    return peak(raw), peak(kept)
