"""The preflight's memory verdict for the machine a training run is about to start on, before anything is built.

``train.py`` calls :func:`training_verdict`: the same traced step as ``preflight.py`` (:func:`run_preflight`),
against the local GPU's memory for a GPU run and against the host's memory for a CPU run — the traced peak of a
CPU step (fp32, the precision a CPU run uses, and the attention it computes: ``model.use_flash_attention=auto`` is
off there) is the bytes its tensors hold; the CUDA context and the allocator's rounding that the prediction adds
make it a slight over-estimate there. The step traced is the one of the run spec resolved for the device the run
starts on (``train.py``'s), not a GPU's: its precision, its ``auto`` switches. A model far too large for the machine
(29 billion parameters on a 24 GiB host) is refused in about a second with the preflight's fixes, instead of
failing in the allocator after a minute of building. A budget of the user's own, ``+preflight.gpu_memory_gib=N``
(and ``+preflight.safety_margin=M``), replaces the machine's: the prediction's error is up to 34% on the measured
rows, so a config at the edge can be started on purpose.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from omegaconf import DictConfig

from voxdiff.preflight.check import PreflightResult, run_preflight
from voxdiff.run.spec import RunSpec, run_spec
from voxdiff.units import GiB

_CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def host_memory_bytes() -> int:
    """Physical memory of this machine, or the cgroup's limit (a container, a Slurm allocation) if lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in _CGROUP_LIMITS:
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return int(total)


def training_verdict(cfg: DictConfig, run: RunSpec | None = None) -> PreflightResult | None:
    """The preflight's verdict for this run on this machine; None when the step is not modelled (a VQ-VAE
    stage 1).

    Args:
        cfg: the run's composed config.
        run: its run spec resolved for the device it starts on (``train.py``'s, :func:`voxdiff.run.spec.run_spec`
            with no device: the precision decided there, ``model.compile``/``use_flash_attention=auto`` resolved
            there); else it is resolved here.

    Raises:
        ConfigError: an unknown ``preflight.gpu`` (:func:`~voxdiff.run.gpus.resolve_gpu`), or any other
            problem of the run spec.
    """
    if run is None:
        run = run_spec(cfg)
    if run.kind != "diffusion":
        return None
    on_host = run.device_type == "cpu" and run.preflight.gpu_memory_gib is None
    processes = run.parallel.processes_per_node
    if on_host:  # a CPU run, and no budget of the user's own (+preflight.gpu_memory_gib=N)
        run = replace(run, preflight=replace(run.preflight, gpu_memory_gib=host_memory_bytes() / processes / GiB))
    result = run_preflight(cfg, name=str(cfg.get("task_name", "")), suggest=True, phases=not on_host,
                           timing=not on_host, run=run)
    if on_host:
        result.budget_source = "host memory" + (f" shared by {processes} processes" if processes > 1 else "")
    return result
