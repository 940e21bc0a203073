"""Files as voxdiff reads and writes them: every ``torch.load`` as data only, every write atomic.

**Reading.** Every ``torch.load`` of the project goes through :func:`load_file`: ``weights_only=True`` (the
unpickler accepts tensors and plain containers and nothing else, so a pickle payload in a file is refused, never
run), with the globals it needs declared in :data:`SAFE_GLOBALS`, and a one-line
:class:`~voxdiff.errors.ConfigError` naming the file, what is wrong with it and what to do — never torch's advice to
retry with ``weights_only=False``. A checkpoint is data in a second sense too: the config stored in it is never
handed to Hydra's ``instantiate`` as it is (:mod:`voxdiff.checkpoint`).

**Writing.** :func:`atomic_write` serialises into a temporary file in the target's folder, flushes and ``fsync``-s
it, then renames it over the target with ``os.replace`` (atomic on POSIX file systems, Lustre and GPFS included)
and ``fsync``-s the folder so the rename itself survives a crash: readers see the old file or the new one, never a
mix. A write that cannot fit is refused before a byte is written, and one that fails anyway (the disk filled up
meanwhile, a quota, an I/O error) is reported as :class:`CheckpointWriteError`, naming the file, the bytes it needs
and the bytes free, instead of PyTorch's ``[enforce fail at inline_container.cc:...] unexpected pos``. Checkpoints
(:class:`voxdiff.lightning.checkpoint_io.AtomicCheckpointIO`), the latent cache, the data module's cache stamps, the
MNI template, the samples' NIfTI and montages (:mod:`voxdiff.viz`) and the evaluation's ``metrics.json`` and report
are written through it, with the permissions a file written in place would get (the old file's, else ``0666`` less
the umask; not the temporary file's ``0600``).

Nothing here imports Lightning; the data modules use it too.
"""

from __future__ import annotations

import errno
import os
import pickle
import re
import shutil
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import torch

from voxdiff.errors import ConfigError
from voxdiff.units import size

__all__ = ["SAFE_GLOBALS", "CheckpointWriteError", "atomic_torch_save", "atomic_write", "load_file", "saved_nbytes"]

#: globals the files voxdiff writes need beyond torch's weights-only defaults. None: checkpoints hold tensors,
#: numbers, strings and containers only (numpy RNG states are stored as lists, voxdiff.lightning.rng; the LR
#: schedule as its ``__dict__``). Add a class here only if a checkpoint really needs it, never a function.
SAFE_GLOBALS: tuple[Any, ...] = ()

_ZIP_MAGIC = b"PK\x03\x04"  # torch.save writes a zip archive

def _reason(exc: BaseException) -> str:
    """The first sentence of an error (torch's go on with advice that does not apply here)."""
    text = str(exc).strip()
    return text.splitlines()[0].split(". ")[0].rstrip(".") if text else type(exc).__name__


def load_file(path: str | Path, key: str, fix: str, *, mmap: bool = False) -> Any:
    """``torch.load(path, weights_only=True)`` on the CPU, or a :class:`ConfigError` in one line.

    Args:
        path: the file.
        key: the config key that named it (``ckpt_path``, ``stage1_ckpt``, ``data.latent_dir`` ...).
        fix: what the user should do instead, in one sentence.
        mmap: map the tensors instead of reading them (for a look at a large checkpoint's metadata).

    Raises:
        ConfigError: the file is missing, empty, not a PyTorch checkpoint, truncated or corrupt, or holds Python
            objects other than tensors and plain data (a pickle payload is refused before it can run).
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(key, str(path), "no such file", fix)
    size = path.stat().st_size
    if size == 0:
        raise ConfigError(key, str(path), "the file is empty (0 bytes: an interrupted copy or write)", fix)
    with open(path, "rb") as fh:
        magic = fh.read(4)
    if magic != _ZIP_MAGIC:
        raise ConfigError(key, str(path), f"is not a PyTorch checkpoint (no zip archive as torch.save writes; "
                          f"{size} bytes starting {magic!r})", fix)
    try:
        with torch.serialization.safe_globals(list(SAFE_GLOBALS)):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:
        found = re.search(r"Unsupported global: GLOBAL (\S+)|Unsupported operand (\d+)", str(exc))
        what = (f"GLOBAL {found.group(1)}" if found and found.group(1) else
                f"pickle opcode {found.group(2)}" if found else "an object it cannot read")
        raise ConfigError(key, str(path), f"holds Python objects, not just tensors and plain data ({what}); "
                          "voxdiff never runs code from a file, so it is refused", fix) from None
    except (RuntimeError, EOFError, OSError, ValueError, KeyError) as exc:
        raise ConfigError(key, str(path), f"is truncated or corrupt ({_reason(exc)})", fix) from None


def check_output(key: str, path: str | os.PathLike[str], *, folder: bool, fix: str) -> Path:
    """Refuse, before any work, an output path a command could not write: checked when the command starts, not
    after minutes of work.

    ``folder=True``: ``path`` is a folder the command creates if missing (with its parents): it must not be a file,
    and its nearest existing ancestor must be a folder this process can write to. ``folder=False``: ``path`` is a
    file: its folder must already exist and be writable, and ``path`` must not be a folder.

    Returns:
        ``path`` as a :class:`~pathlib.Path` (``~`` expanded).

    Raises:
        ConfigError: naming ``key``, the path, what stands in the way and ``fix``.
    """
    target = Path(path).expanduser()
    if str(path) == "":
        raise ConfigError(key, path, "is empty", fix)
    if folder:
        if target.exists() and not target.is_dir():
            raise ConfigError(key, str(path), "exists and is a file, not a folder", fix)
        nearest = target
        while not nearest.exists() and nearest != nearest.parent:
            nearest = nearest.parent
        if not nearest.is_dir():
            raise ConfigError(key, str(path), f"cannot be created: {nearest} is a file, not a folder", fix)
    else:
        if target.is_dir():
            raise ConfigError(key, str(path), "is a folder; it must name a file", fix)
        nearest = target.parent
        if not nearest.is_dir():
            raise ConfigError(key, str(path), f"its folder {nearest} does not exist", f"create it (mkdir -p "
                              f"{nearest}) or {fix[0].lower() + fix[1:]}")
    if not os.access(nearest, os.W_OK | os.X_OK):
        raise ConfigError(key, str(path), f"cannot be written: {nearest} is not writable by this user", fix)
    return target


class CheckpointWriteError(OSError):
    """A checkpoint could not be written; the message names the file, what it needs and what is free. The
    previous file at that path is intact and no temporary file is left behind."""


def _no_space(target: Path, need: int | None) -> CheckpointWriteError:
    free = shutil.disk_usage(target.parent).free
    needs = f"the checkpoint needs {size(need)}, " if need else ""
    return CheckpointWriteError(
        errno.ENOSPC,
        f"no space left on {target.parent}: {needs}{size(free)} free, to write {target.name} beside the "
        f"previous one (an atomic write keeps the old file until the new one is complete). "
        + ("The previous checkpoint is intact" if target.exists() else "No partial file was left")
        + ". Free space there, or point paths.run_dir at a file system with room")


def _new_file_mode(target: Path) -> int:
    """The permissions a file written in place would have: the old file's, else ``0666`` less the umask (what a
    file renamed into place from ``tempfile.mkstemp``, which creates ``0600``, should be given)."""
    try:
        return stat.S_IMODE(target.stat().st_mode)
    except OSError:
        mask = os.umask(0)
        os.umask(mask)
        return 0o666 & ~mask


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
        os.fchmod(fd, _new_file_mode(target))  # mkstemp's 0600 would hide the file from the user's group
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if out_of_space(exc):
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


def out_of_space(exc: BaseException) -> bool:
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
