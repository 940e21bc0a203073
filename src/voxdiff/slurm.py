"""Slurm's own formats, read without Slurm: ``slurm/site.env``, memory sizes, time limits, a job's memory.

``scripts/render_slurm.py`` renders the job scripts from ``slurm/site.env``; the preflight reads the same file (and
an experiment's ``slurm:`` overrides) to plan a run's host memory and its requeues. No torch, no Hydra here.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path


def read_site_env(path: Path) -> dict[str, str]:
    """``KEY=VALUE`` lines of ``slurm/site.env`` (comments and blank lines skipped).

    Raises:
        ValueError: a line that is not ``KEY=VALUE``, naming the file and the line.
    """
    values = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep:
            raise ValueError(f"{path}:{number}: expected KEY=VALUE, got {line!r}")
        values[key.strip()] = value.strip()
    return values


_MEM = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)B?\s*$", re.IGNORECASE)


def parse_slurm_memory(text: str) -> int:
    """Slurm's memory size (``64G``, ``128000`` MB by default, ``1.5T``) in bytes.

    Raises:
        ValueError: not a Slurm memory size.
    """
    m = _MEM.match(str(text))
    if not m:
        raise ValueError(f"{text!r} is not a Slurm memory size (e.g. 64G, 128000M)")
    return int(float(m.group(1)) * 1024 ** "KMGT".index((m.group(2) or "M").upper()) * 1024)


def slurm_job_memory(env: Mapping[str, str]) -> int | None:
    """The memory of this node's share of a running Slurm job, from its environment, or None outside one (or for
    ``--mem=0``, which gives the job all of the node's memory)."""
    if "SLURM_MEM_PER_NODE" in env:
        return int(env["SLURM_MEM_PER_NODE"]) * 2**20 or None
    gpus = env.get("SLURM_GPUS_ON_NODE")
    if "SLURM_MEM_PER_GPU" in env and gpus:
        return int(env["SLURM_MEM_PER_GPU"]) * 2**20 * int(gpus)
    cpus = env.get("SLURM_CPUS_ON_NODE")
    if "SLURM_MEM_PER_CPU" in env and cpus:
        return int(env["SLURM_MEM_PER_CPU"]) * 2**20 * int(cpus)
    return None


def parse_slurm_time(text: str) -> float:
    """Slurm's time limit (``MM``, ``MM:SS``, ``HH:MM:SS``, ``D-HH``, ``D-HH:MM``, ``D-HH:MM:SS``) in seconds.

    Raises:
        ValueError: not a Slurm time (``UNLIMITED`` included: there is then no limit to plan for).
    """
    text = str(text).strip()
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", text)
    if not m:
        raise ValueError(f"{text!r} is not a Slurm time limit (e.g. 2-00:00:00, 48:00:00, 90)")
    days, a, b, c = (int(g) if g is not None else None for g in m.groups())
    if days is not None:  # D-HH[:MM[:SS]]
        return float(((days * 24 + a) * 60 + (b or 0)) * 60 + (c or 0))
    if c is not None:
        return float((a * 60 + b) * 60 + c)
    if b is not None:  # MM:SS
        return float(a * 60 + b)
    return float(a * 60)  # minutes
