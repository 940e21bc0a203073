"""Files that every rank of a multi-process run needs and one rank writes: the others wait for it.

Under DDP/FSDP (``srun``, ``torchrun`` or Lightning's launcher) every process runs the same data set-up. Data that
is made once and kept on disk — the subjects made from a template (``data=mni_template``), a latent cache
(``cache_latents.py`` launched on several processes) — is written by one process; the others wait until its
completion marker says the write is complete, then read it. Writes are atomic (temporary file, rename), so a rank
never reads half a file even where two writers meet (two nodes on one shared file system, each with its own
writer: they write the same bytes).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

#: how long a waiting rank waits for the writer before it gives up (seconds)
WAIT_S = 3600.0


def launch_rank(scope: str = "node") -> int:
    """This process's rank among the processes of its launch: on its node (``scope="node"``: ``LOCAL_RANK``,
    ``SLURM_LOCALID``) or in the whole run (``scope="world"``: ``RANK``, ``SLURM_PROCID``); 0 outside a launcher."""
    names = ("LOCAL_RANK", "SLURM_LOCALID") if scope == "node" else ("RANK", "SLURM_PROCID")
    for name in names:
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 0


def one_writes(write: Callable[[], T], done: Callable[[], bool], what: str, scope: str = "node",
               timeout_s: float = WAIT_S, poll_s: float = 0.2) -> T | None:
    """Run ``write()`` on rank 0 of ``scope`` (:func:`launch_rank`); on the other ranks wait until ``done()``.

    Args:
        write: makes the files (and their completion marker, last); its result is returned on the writer.
        done: whether the writer's files are complete (its marker is there).
        what: the files, for the waiting ranks' log and the timeout's message.
        scope: ``node`` (one writer per node: a node-local or a shared folder) or ``world`` (one writer; the
            folder must be shared by every node).
        timeout_s: give up waiting after this long.
        poll_s: how often a waiting rank looks.

    Returns:
        ``write()``'s result on the writer, None on the others.

    Raises:
        TimeoutError: the writer did not finish within ``timeout_s`` (it failed: its log says why).
    """
    rank = launch_rank(scope)
    if rank == 0:
        return write()
    print(f"[voxdiff] rank {rank}: waiting for rank 0 of the {scope} to write {what}", flush=True)
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank} waited {timeout_s:.0f} s for rank 0 of the {scope} to write {what}; "
                               "it did not finish: see rank 0's log" + (" (with scope 'world', every node must "
                                                                        "see the same folder)" if scope == "world"
                                                                        else ""))
        time.sleep(poll_s)
    return None
