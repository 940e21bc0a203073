"""Which subjects train and which validate: a split that depends only on the subjects' names and a seed (no
Lightning here: the preflight reads it too)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from voxdiff.errors import ConfigError, integer, number


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


def split_settings(val_fraction: Any, split_seed: Any) -> tuple[float, int]:
    """``data.val_fraction`` in (0, 1) and ``data.split_seed``, an integer: what :func:`split_subjects` takes.

    Raises:
        ConfigError: naming the key, the value and a fix.
    """
    return (number("data.val_fraction", val_fraction, lo=0, hi=1, lo_open=True, hi_open=True, example=0.25),
            integer("data.split_seed", split_seed, fix="set data.split_seed to an integer"))


def check_num_subjects(num_subjects: Any) -> int:
    """``data.num_subjects``, the subjects a data module makes (the phantom's, or a template's): an integer >= 0.

    Raises:
        ConfigError: naming the key, the value and a fix.
    """
    return integer("data.num_subjects", num_subjects, minimum=0, fix="set data.num_subjects to 2 or more")


def check_drop_last(drop_last: Any, batch_size: int, train_subjects: int, world: int = 1) -> bool:
    """``data.drop_last``: whether the training loader leaves out an epoch's last, smaller batch.

    A compiled training step is compiled for one batch shape: a smaller last batch compiles a second graph
    (minutes on a GPU) and, with CUDA graphs, records a second one, neither of which the preflight predicts. The
    configs take it on a GPU (``${voxdiff.cpu_or:false,true}``) and not on the CPU, where nothing is compiled by
    default and a small data set would lose a large share of its subjects each epoch (each is still seen: the
    loader reshuffles every epoch).

    ``world``: the processes the training subjects are shared between (each gets ``train_subjects // world``;
    the data modules check again with it once the Trainer is attached).

    Raises:
        ConfigError: not a boolean; or set with ``batch_size`` above one process's training subjects (not one
            whole batch left).
    """
    if not isinstance(drop_last, bool):
        raise ConfigError("data.drop_last", drop_last, "must be true or false",
                          "set data.drop_last=true (whole batches only) or false")
    share = train_subjects // max(world, 1)
    if drop_last and batch_size > share:
        where = f" ({share} for each of {world} processes)" if world > 1 else ""
        raise ConfigError("data.batch_size", batch_size,
                          f"is more than the {train_subjects} training subjects{where}: with data.drop_last=true "
                          "(the default on a GPU) not one whole batch is left",
                          f"set data.batch_size={share} or less, or data.drop_last=false")
    return drop_last
