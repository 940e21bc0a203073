"""What a trace cannot see: the CUDA caching allocator's segments and the CUDA context (the cuBLAS workspaces of
each GPU type: :mod:`voxdiff.run.gpus`).

All sizes are bytes; GiB means 2**30 bytes.

The caching allocator model replays the allocation/free sequence of a trace through the policy of
``c10/cuda/CUDACachingAllocator.cpp`` (torch 2.13, default settings, no memory pressure):

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

import bisect

from voxdiff.units import GiB, MiB

__all__ = [
    "CUDA_CONTEXT_BYTES",
    "K_LARGE_BUFFER",
    "K_MIN_LARGE_ALLOC",
    "K_ROUND_LARGE",
    "K_SMALL_BUFFER",
    "K_SMALL_SIZE",
    "segment_size",
    "simulate_reserved",
]

K_SMALL_SIZE = 1 * MiB  # largest "small" request
K_SMALL_BUFFER = 2 * MiB  # small-pool segment size
K_LARGE_BUFFER = 20 * MiB  # large-pool segment size for requests below K_MIN_LARGE_ALLOC
K_MIN_LARGE_ALLOC = 10 * MiB
K_ROUND_LARGE = 2 * MiB  # large requests are rounded up to this when a segment is created
K_MIN_BLOCK = 512

CUDA_CONTEXT_BYTES = GiB // 2
"""CUDA context + kernel images, not counted by the caching allocator. PyTorch's CUDA notes ("Memory
management") and NVIDIA's lazy-loading docs put it at roughly 300-600 MB on current drivers with
``CUDA_MODULE_LOADING=LAZY`` (the default since CUDA 11.7 / torch 2.0); 0.5 GiB is the middle of that range."""


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
            split = rest >= K_MIN_BLOCK if small else rest > K_SMALL_SIZE
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
