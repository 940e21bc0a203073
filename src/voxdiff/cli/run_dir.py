"""A run directory belongs to one run at a time, and a fresh run never overwrites another run's checkpoints.

:func:`claim` (rank 0 of a training run, before anything is written) does three things:

1. takes ``<run dir>/.voxdiff.lock`` (created with ``O_EXCL``; it records pid, host, start time, command and the
   Slurm job). A second run on the same directory stops at once, naming the first one's pid and host. A lock
   whose process is gone (same host, dead pid) or that an earlier run of the same Slurm job left (a requeue) is
   stale: it is replaced, and the run says so. A lock from another host cannot be checked: the message says to
   delete it if that run is over.
2. refuses a fresh run (``ckpt_path=null``) in a directory that holds checkpoints (``checkpoints/*.ckpt``,
   ``hpc_ckpt_*.ckpt``), and a run that continues *another* run's checkpoint there: ``ckpt_path=auto`` resumes
   this directory's run, ``overwrite=true`` starts over in it.
3. removes the temporary files an interrupted atomic checkpoint write left (``.<name>.ckpt.<random>.tmp``, see
   :func:`voxdiff.files.atomic_write`), and says so.

``python train.py`` claims the directory in :class:`RunDirGuard`, a Hydra callback that runs before Hydra writes
``.hydra/`` into it, so a refused run does not even overwrite the running one's config record; in-process
callers (tests) get the same from ``train()``. :func:`release` gives the lock back when the run ends.
"""

from __future__ import annotations

import atexit
import datetime as _dt
import json
import os
import re
import socket
import sys
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from voxdiff.cli.exit_codes import EXIT_CONFIG
from voxdiff.config import check_name
from voxdiff.errors import ConfigError
from voxdiff.files import check_output

LOCK_NAME = ".voxdiff.lock"
#: a temporary file of voxdiff's atomic checkpoint writer (tempfile.mkstemp(prefix=".<name>.", suffix=".tmp"))
_TEMP_FILE = re.compile(r"^\..+\.ckpt\.[A-Za-z0-9_]+\.tmp$")

_HELD: dict[str, RunDirLock] = {}


def process_rank() -> int:
    """The global rank of this process from the launcher's environment (torchrun, srun, Lightning's launcher)."""
    for name in ("RANK", "SLURM_PROCID", "LOCAL_RANK"):
        value = os.environ.get(name)
        if value not in (None, ""):
            try:
                return int(value)
            except ValueError:
                continue
    return 0


def checkpoints_in(run_dir: str | Path) -> list[Path]:
    """The checkpoints of a run directory: ``checkpoints/*.ckpt`` and Slurm's ``hpc_ckpt_*.ckpt``."""
    run_dir = Path(run_dir)
    return sorted([*run_dir.glob("hpc_ckpt_*.ckpt"), *(run_dir / "checkpoints").glob("*.ckpt")])


def stale_temp_files(run_dir: str | Path) -> list[Path]:
    """Temporary files of voxdiff's atomic checkpoint writer in a run directory (left by a hard kill)."""
    run_dir = Path(run_dir)
    return sorted(p for d in (run_dir, run_dir / "checkpoints") if d.is_dir() for p in d.iterdir()
                  if p.is_file() and _TEMP_FILE.match(p.name))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


class RunDirLock:
    """``<run dir>/.voxdiff.lock``: held by one process; see the module docstring."""

    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        self.held = False

    def _record(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "host": socket.gethostname(),
                "started": _dt.datetime.now().isoformat(timespec="seconds"),
                "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])[:500],
                "slurm_job_id": os.environ.get("SLURM_JOB_ID")}

    def _read(self) -> dict[str, Any] | None:
        try:
            info = json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}
        return info if isinstance(info, dict) else {}

    def _stale(self, info: dict[str, Any]) -> str | None:
        """Why a lock is stale, or None when its run may still be alive."""
        job = os.environ.get("SLURM_JOB_ID")
        if job and str(info.get("slurm_job_id")) == job:
            return f"an earlier run of this Slurm job {job} (requeued) left it"
        pid = info.get("pid")
        if info.get("host") == socket.gethostname() and isinstance(pid, int):
            if pid == os.getpid():
                return None
            if not _alive(pid):
                return f"its process {pid} on {info.get('host')} no longer exists"
        if not info:  # unreadable; a lock that is seconds old may still be being written by a starting run
            age = _dt.datetime.now().timestamp() - self.path.stat().st_mtime if self.path.exists() else 1e9
            return "it is unreadable" if age > 10 else None
        return None

    def acquire(self) -> list[str]:
        """Take the lock; returns what was done (a stale lock replaced), for the user.

        Raises:
            ConfigError: another live run (or one on another host) holds it.
        """
        notes: list[str] = []
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                info = self._read()
                if info is None:  # gone between the two calls: try again
                    continue
                reason = self._stale(info)
                if reason is None:
                    where = f"pid {info.get('pid')} on {info.get('host')}"
                    raise ConfigError(
                        "paths.run_dir", str(self.run_dir),
                        f"is in use by another run ({where}, started {info.get('started')}: "
                        f"{info.get('command', '?')})",
                        "wait for that run to end or stop it, or choose another paths.run_dir; if it is no longer "
                        f"running (e.g. a crash on another host), delete {self.path}")
                self.path.unlink(missing_ok=True)
                notes.append(f"removed a stale lock of {self.run_dir}: {reason}")
                continue
            with os.fdopen(fd, "w") as fh:
                json.dump(self._record(), fh)
            self.held = True
            return notes
        raise ConfigError("paths.run_dir", str(self.run_dir), f"could not take the lock {self.path}",
                          "check that the folder is writable, or choose another paths.run_dir")

    def release(self) -> None:
        if not self.held:
            return
        info = self._read()
        if info and info.get("pid") == os.getpid():
            self.path.unlink(missing_ok=True)
        self.held = False


def claim(run_dir: str | Path, ckpt_path: Any, overwrite: bool = False) -> list[str]:
    """Lock ``run_dir`` for this run, refuse to overwrite its checkpoints, clean stale temp files.

    Idempotent within a process (the Hydra callback and ``train()`` both call it). Call on rank 0 only.

    Args:
        run_dir: the run directory (created if missing).
        ckpt_path: the run's ``ckpt_path`` (None: a fresh run; ``auto``/``last``/a path: a resume).
        overwrite: the user's ``overwrite=true``: a fresh run may replace the checkpoints there.

    Returns:
        Messages for the user (a stale lock replaced, temp files removed).

    Raises:
        ConfigError: the directory is in use, or the run would overwrite checkpoints it does not continue.
    """
    run_dir = Path(run_dir).expanduser()
    key = str(run_dir.resolve())
    if key in _HELD:
        return []
    check_output("paths.run_dir", run_dir, folder=True, fix="choose a folder this user can write to "
                 "(paths.run_dir=DIR, or paths.log_dir=DIR for the default <log_dir>/<task_name>/<time>)")
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = RunDirLock(run_dir)
    notes = lock.acquire()
    try:
        existing = checkpoints_in(run_dir)
        if existing and not overwrite:
            names = ", ".join(str(p.relative_to(run_dir)) for p in existing[:3]) + (" ..." if len(existing) > 3 else "")
            if ckpt_path is None:
                raise ConfigError(
                    "ckpt_path", None, f"the run directory {run_dir} already holds checkpoints ({names}), which a "
                    "fresh run would overwrite",
                    "resume that run with ckpt_path=auto, start in another directory (paths.run_dir=DIR), or pass "
                    "overwrite=true to start over here")
            ckpt = str(ckpt_path)
            if ckpt not in ("auto", "last") and "://" not in ckpt:
                inside = Path(ckpt).expanduser().resolve().is_relative_to(run_dir.resolve())
                if not inside:
                    raise ConfigError(
                        "ckpt_path", ckpt_path, f"continues another run, but the run directory {run_dir} holds "
                        f"checkpoints of its own ({names}), which this run would overwrite",
                        "continue in a new directory (paths.run_dir=DIR), resume this directory's run with "
                        "ckpt_path=auto, or pass overwrite=true")
        stale = stale_temp_files(run_dir)
        for path in stale:
            path.unlink(missing_ok=True)
        if stale:
            notes.append(f"removed {len(stale)} temporary file(s) of interrupted checkpoint writes in {run_dir}: "
                         + ", ".join(str(p.relative_to(run_dir)) for p in stale))
    except BaseException:
        lock.release()
        raise
    _HELD[key] = lock
    return notes


def release(run_dir: str | Path) -> None:
    """Give back the lock this process holds on ``run_dir`` (no-op if it holds none)."""
    lock = _HELD.pop(str(Path(run_dir).expanduser().resolve()), None)
    if lock is not None:
        lock.release()


@atexit.register
def _release_all() -> None:
    for key in list(_HELD):
        release(key)


#: what ``paths.output_dir`` is in ``configs/paths/default.yaml``: the folder Hydra runs in (``paths.run_dir``, or a
#: multirun's job folder)
OUTPUT_DIR = "${hydra:runtime.output_dir}"


def check_output_dir_follows_hydra(config: Any) -> None:
    """A command line run of an entry point keeps ``paths.output_dir`` as Hydra's run folder. Set to a folder of its
    own, the run would be split: checkpoints, samples and metrics there, while Hydra's config and log and the run's
    lock go to ``paths.run_dir`` (and a second run started in the same second would be refused as a duplicate).

    Raises:
        ConfigError: naming ``paths.output_dir``, its value and ``paths.run_dir`` as the fix.
    """
    paths = config.get("paths")
    if paths is None or "output_dir" not in paths:
        return
    raw = OmegaConf.to_container(paths, resolve=False).get("output_dir")
    if raw != OUTPUT_DIR:
        raise ConfigError("paths.output_dir", raw, "is the folder Hydra runs in; set on its own it splits the run "
                          "(checkpoints there; the config, the log and the run's lock in paths.run_dir)",
                          f"use paths.run_dir={raw} instead")


try:
    from hydra.experimental.callback import Callback as _HydraCallback
except ImportError:  # pragma: no cover - hydra is a dependency
    _HydraCallback = object  # type: ignore[misc,assignment]


class RunDirGuard(_HydraCallback):
    """Hydra callback (``configs/hydra/default.yaml``): checks the run's names and claims a training run's directory
    *before* Hydra creates it and writes ``.hydra/`` (``on_run_start``).

    Every entry point: ``task_name`` must be a plain name (it is a folder of the run directory). Training runs (a
    config with ``overwrite``, i.e. ``train.yaml``) on rank 0: :func:`claim`. A refusal prints one line and exits
    with ``EXIT_CONFIG``.
    """

    def on_run_start(self, config: Any, **kwargs: Any) -> None:
        try:
            check_name("task_name", config.get("task_name"))
            if not str(config.hydra.run.dir).strip():  # paths.run_dir= would run (and write) in the current folder
                raise ConfigError("paths.run_dir", "", "is empty: the run would write into the current directory",
                                  "name a folder, e.g. paths.run_dir=runs/exp11_a, or leave it out (logs/<task>/<time>)")
            check_output_dir_follows_hydra(config)
            if "overwrite" in config and process_rank() == 0:
                for note in claim(Path(str(config.hydra.run.dir)), config.get("ckpt_path"),
                                  bool(config.get("overwrite"))):
                    print(f"[voxdiff] {note}", flush=True)
        except ConfigError as err:
            print(f"[voxdiff] config error: {err}", file=sys.stderr, flush=True)
            raise SystemExit(EXIT_CONFIG) from None
