"""Byte units and how voxdiff writes sizes, once.

:data:`GiB` (2**30 bytes) is the unit of GPU and host memory (``torch.cuda`` and ``nvidia-smi`` count in it);
:func:`size` writes a size in decimal units, as ``df -h``-like figures of disks and files read; :func:`memory_size`
writes one in GiB or MiB, as memory figures read.
"""

from __future__ import annotations

__all__ = ["GiB", "KiB", "MiB", "memory_size", "size"]

KiB = 2**10
MiB = 2**20
GiB = 2**30


def size(nbytes: float) -> str:
    """Bytes in the unit a user reads off ``df -h``-like figures (decimal TB/GB/MB/kB)."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{int(nbytes)} B"


def memory_size(nbytes: int) -> str:
    """Bytes of memory: GiB from 1 GiB up, else MiB."""
    return f"{nbytes / GiB:.2f} GiB" if nbytes >= GiB else f"{nbytes / MiB:.1f} MiB"
