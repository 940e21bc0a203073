"""Debian packages the tests need (Slurm's daemons, chromium), installed with apt-get when missing: the suite sets
itself up on a fresh machine.

The suite runs in two pytest-xdist workers, and each may reach a test that needs a package at the same moment
(session 25: the Slurm tests of both workers on a fresh machine, one ``apt-get install`` failing with exit 100 on
dpkg's lock while the other held it). So one install runs at a time (an exclusive ``flock`` on :data:`LOCK`), a
process that waited looks again before installing, and apt itself waits for a lock held by anything else
(``DPkg::Lock::Timeout``). A failed apt-get says which command and why (its stderr)."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from collections.abc import Sequence

#: the lock every test process takes around apt-get
LOCK = Path(tempfile.gettempdir()) / "voxdiff-tests-apt.lock"
#: how long apt-get waits for a dpkg lock held by another program, in seconds
DPKG_LOCK_TIMEOUT_S = 600


def _missing(binaries: Sequence[str]) -> list[str]:
    return [b for b in binaries if not shutil.which(b)]


def ensure(packages: Sequence[str], binaries: Sequence[str]) -> None:
    """Install ``packages`` with apt-get unless every one of ``binaries`` is on ``PATH`` already.

    Raises:
        RuntimeError: not root or no apt-get (naming the command to run), an apt-get that failed (its command, exit
            status and stderr), or an install after which a binary is still missing.
    """
    if not _missing(binaries):
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise RuntimeError(f"{', '.join(binaries)} not installed and cannot be installed here (needs root and "
                           f"apt-get): apt-get install {' '.join(packages)}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    wait = ["-o", f"DPkg::Lock::Timeout={DPKG_LOCK_TIMEOUT_S}"]
    with open(LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not _missing(binaries):
            return  # another process installed them while this one waited
        for cmd in (["apt-get", *wait, "update", "-qq"],
                    ["apt-get", *wait, "install", "-y", "-qq", "--no-install-recommends", *packages]):
            done = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}: {done.stderr.strip()[-2000:]}")
    missing = _missing(binaries)
    if missing:
        raise RuntimeError(f"apt-get install {' '.join(packages)} finished but {', '.join(missing)} is not on PATH")
