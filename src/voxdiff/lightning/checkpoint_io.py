"""Checkpoints written atomically: a crash or a SLURM kill mid-write never leaves a truncated ``last.ckpt``.

The checkpoint is serialised into a temporary file in the target's folder, flushed and ``fsync``-ed, then renamed
over the target with ``os.replace`` (atomic on POSIX file systems, Lustre and GPFS included) and the folder is
``fsync``-ed so the rename itself survives a crash. Readers see the old file or the new one, never a mix.
Non-local paths (``s3://`` …) fall back to Lightning's own writer.

A checkpoint that cannot fit is refused before a byte is written, and a write that fails anyway (the disk filled
up meanwhile, a quota, an I/O error) is reported as :class:`CheckpointWriteError`, naming the file, the bytes it
needs and the bytes free, instead of PyTorch's ``[enforce fail at inline_container.cc:...] unexpected pos``.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from pathlib import Path
from collections.abc import Callable
from typing import Any, BinaryIO

import torch
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol
from lightning.pytorch.plugins.io import TorchCheckpointIO


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


class CheckpointWriteError(OSError):
    """A checkpoint could not be written; the message names the file, what it needs and what is free. The
    previous file at that path is intact and no temporary file is left behind."""


def _no_space(target: Path, need: int | None) -> CheckpointWriteError:
    free = shutil.disk_usage(target.parent).free
    needs = f"the checkpoint needs {_size(need)}, " if need else ""
    return CheckpointWriteError(
        errno.ENOSPC,
        f"no space left on {target.parent}: {needs}{_size(free)} free, to write {target.name} beside the "
        f"previous one (an atomic write keeps the old file until the new one is complete). The previous "
        f"checkpoint is intact. Free space there, or point paths.run_dir at a file system with room")


def atomic_write(path: str | os.PathLike[str], write: Callable[[BinaryIO], Any], nbytes: int | None = None) -> Path:
    """Write ``path`` with ``write(file)`` through a temporary file in the same folder, fsync and ``os.replace``.

    If anything fails before the rename (serialisation, a full disk, a kill), ``path`` keeps its previous
    content and the temporary file is removed (a hard kill can leave a ``.<name>.*.tmp`` behind, never a
    truncated ``path``).

    Args:
        path: the file to (over)write.
        write: writes the content to the open binary file.
        nbytes: the size the content will have, if known: refused before writing when the folder has less free.

    Raises:
        CheckpointWriteError: not enough space (before or during the write), or another OS error while writing;
            the message says which file and why.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    if nbytes is not None and shutil.disk_usage(target.parent).free < nbytes:
        raise _no_space(target, nbytes)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if _out_of_space(exc):
            raise _no_space(target, nbytes) from exc
        if isinstance(exc, OSError) and not isinstance(exc, CheckpointWriteError):
            raise CheckpointWriteError(exc.errno, f"writing {target} failed: {exc.strerror or exc}") from exc
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


def _out_of_space(exc: BaseException) -> bool:
    """A full disk, as the OS reports it or as PyTorch's zip writer does (``unexpected pos``, ``file write
    failed``), walking the exception's causes."""
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if isinstance(exc, RuntimeError) and ("unexpected pos" in str(exc) or "file write failed" in str(exc)):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def saved_nbytes(obj: Any) -> int:
    """The bytes ``torch.save(obj)`` writes, from below: every distinct tensor storage once (a zip entry each,
    64-byte aligned). Pickled metadata adds a little more."""
    seen: dict[tuple[int, str], int] = {}

    def visit(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            storage = x.untyped_storage()
            seen[(storage.data_ptr(), str(storage.device))] = storage.nbytes()
        elif isinstance(x, dict):
            for v in x.values():
                visit(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                visit(v)

    visit(obj)
    return sum(-(-n // 64) * 64 for n in seen.values())


def atomic_torch_save(obj: Any, path: str | os.PathLike[str]) -> Path:
    """``torch.save(obj, path)`` through :func:`atomic_write`, refused up front when the folder lacks the room."""
    return atomic_write(path, lambda f: torch.save(obj, f), nbytes=saved_nbytes(obj))


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
