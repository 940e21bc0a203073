"""Which subjects train and which validate: a split that depends only on the subjects' names and a seed (no
Lightning here: the preflight reads it too)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence


def split_subjects(names: Sequence[str], val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Split subjects into train and validation indices, deterministically.

    Subjects are ranked by a hash of ``(seed, name)`` and the first ``round(n · val_fraction)`` (at least 1, at
    most ``n - 1``) go to validation. The split depends only on the names and the seed, not on their order, and
    adding a subject moves at most one other subject between the sets.

    Args:
        names: subject names (at least 2, unique).
        val_fraction: fraction of subjects for validation, in (0, 1).
        seed: the split seed.

    Returns:
        ``(train_indices, val_indices)``, each sorted, together a partition of ``range(len(names))``.
    """
    n = len(names)
    if n < 2:
        raise ValueError(f"need at least 2 subjects to split, got {n}")
    n_val = min(max(int(round(n * val_fraction)), 1), n - 1)
    rank = sorted(range(n), key=lambda i: hashlib.sha256(f"{seed}\0{names[i]}".encode()).hexdigest())
    val = sorted(rank[:n_val])
    train = sorted(rank[n_val:])
    return train, val
