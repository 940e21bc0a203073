"""Checkpoints written atomically: a crash or a SLURM kill mid-write never leaves a truncated ``last.ckpt``.

The checkpoint is serialised into a temporary file in the target's folder, flushed and ``fsync``-ed, then renamed
over the target with ``os.replace`` (atomic on POSIX file systems, Lustre and GPFS included) and the folder is
``fsync``-ed so the rename itself survives a crash. Readers see the old file or the new one, never a mix.
Non-local paths (``s3://`` …) fall back to Lightning's own writer.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from collections.abc import Callable
from typing import Any, BinaryIO

import torch
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol
from lightning.pytorch.plugins.io import TorchCheckpointIO


def atomic_write(path: str | os.PathLike[str], write: Callable[[BinaryIO], Any]) -> Path:
    """Write ``path`` with ``write(file)`` through a temporary file in the same folder, fsync and ``os.replace``.

    If anything fails before the rename (serialisation, a full disk, a kill), ``path`` keeps its previous
    content and the temporary file is removed (a hard kill can leave a ``.<name>.*.tmp`` behind, never a
    truncated ``path``).
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    try:  # make the rename durable
        dir_fd = os.open(target.parent, os.O_RDONLY)
    except OSError:
        return target
    try:
        os.fsync(dir_fd)
    except OSError:
        pass  # some file systems do not support fsync on directories
    finally:
        os.close(dir_fd)
    return target


def atomic_torch_save(obj: Any, path: str | os.PathLike[str]) -> Path:
    """``torch.save(obj, path)`` through :func:`atomic_write`."""
    return atomic_write(path, lambda f: torch.save(obj, f))


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning ``CheckpointIO`` plugin that writes checkpoints with :func:`atomic_torch_save`.

    ``Trainer(plugins=[AtomicCheckpointIO()])``; loading and removal are Lightning's.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options")
        if not _is_local_file_protocol(str(path)):
            super().save_checkpoint(checkpoint, path)
            return
        atomic_torch_save(checkpoint, path)
