"""Capture and restore every random generator a training step touches: torch (CPU and CUDA), numpy, python.

Lightning's checkpoints hold none of them; with them a resumed run draws the same timesteps, noise and data order
as an uninterrupted one. Under DDP each rank's states are gathered, so each rank gets its own back.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def _numpy_state_plain(state: tuple) -> tuple:
    """numpy's legacy state with its key array as a list of ints: loadable with ``torch.load(weights_only=True)``."""
    name, keys, pos, has_gauss, cached = state
    return (str(name), [int(k) for k in keys], int(pos), int(has_gauss), float(cached))


def rng_state() -> dict[str, Any]:
    """The current states of python's, numpy's and torch's generators (CUDA's where CUDA is initialised)."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": _numpy_state_plain(np.random.get_state()),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore states captured by :func:`rng_state` (CUDA's only where CUDA is available)."""
    random.setstate(state["python"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        cuda = state["cuda"]
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
        else:  # a different GPU count: restore what maps one to one
            for i, s in enumerate(cuda[: torch.cuda.device_count()]):
                torch.cuda.set_rng_state(s, i)


def gather_rng_states() -> list[dict[str, Any]]:
    """Every rank's :func:`rng_state`, indexed by global rank (one entry without ``torch.distributed``).

    Collective under DDP: every rank must call it (Lightning calls ``on_save_checkpoint`` on all ranks).
    """
    mine = rng_state()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        states: list[Any] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(states, mine)
        return states
    return [mine]


def restore_rng_states(states: list[dict[str, Any]], rank: int) -> None:
    """Restore this rank's states from :func:`gather_rng_states`'s list (rank 0's when the world size changed)."""
    set_rng_state(states[rank] if rank < len(states) else states[0])
