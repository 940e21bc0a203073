"""The preflight's memory verdict for the machine a training run is about to start on, before anything is built.

``train.py`` calls :func:`training_verdict`: the same traced step as ``preflight.py`` (:func:`run_preflight`),
against the local GPU's memory for a GPU run and against the host's memory for a CPU run — the traced peak of a
CPU step (fp32, the precision a CPU run uses, and the attention it computes: ``model.use_flash_attention=auto`` is
off there) is the bytes its tensors hold; the CUDA context and the allocator's rounding that the prediction adds
make it a slight over-estimate there. A model far too large for the machine
(29 billion parameters on a 24 GiB host) is refused in about a second with the preflight's fixes, instead of
failing in the allocator after a minute of building. A budget of the user's own, ``+preflight.gpu_memory_gib=N``
(and ``+preflight.safety_margin=M``), replaces the machine's: the prediction's error is up to 34% on the measured
rows, so a config at the edge can be started on purpose.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from voxdiff.config import run_kind
from voxdiff.errors import ConfigError
from voxdiff.preflight.check import PreflightResult, gpu_precision, run_preflight
from voxdiff.preflight.gpus import resolve_gpu
from voxdiff.preflight.memory import GiB

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


def _local_processes(cfg: DictConfig) -> int:
    devices = OmegaConf.select(cfg, "trainer.devices", default=1)
    if isinstance(devices, int) and devices > 0:
        return devices
    if OmegaConf.is_list(devices):
        return max(1, len(devices))
    return 1


def training_verdict(cfg: DictConfig) -> PreflightResult | None:
    """The preflight's verdict for this run on this machine; None when the step is not modelled (a VQ-VAE stage
    1, or a precision the preflight does not model).

    Raises:
        ConfigError: an unknown ``preflight.gpu`` (:func:`~voxdiff.preflight.gpus.resolve_gpu`).
    """
    from voxdiff.lightning.trainer import resolve_precision
    from voxdiff.step import accelerator_device

    if run_kind(cfg) != "diffusion":
        return None
    accelerator = OmegaConf.select(cfg, "trainer.accelerator", default="auto")
    checked = copy.deepcopy(cfg)
    gpu = resolve_gpu(checked)  # an unknown preflight.gpu is the user's to fix, not a reason to skip the verdict
    try:  # the precision this machine runs (voxdiff.step.decide_precision), then as the preflight predicts it
        OmegaConf.update(checked, "trainer.precision", resolve_precision(OmegaConf.select(cfg, "trainer.precision"),
                                                                          accelerator), force_add=True)
        gpu_precision(checked, gpu)
    except ConfigError:
        return None
    on_cpu = accelerator_device(accelerator) == "cpu"
    on_host = on_cpu and OmegaConf.select(cfg, "preflight.gpu_memory_gib") is None
    if on_cpu:  # model.compile=auto compiles CUDA runs only: a CPU run's step is eager
        _resolve_on_cpu(checked, "model.compile")
    if on_host:  # a CPU run, and no budget of the user's own (+preflight.gpu_memory_gib=N)
        processes = _local_processes(cfg)
        OmegaConf.update(checked, "preflight.gpu_memory_gib", host_memory_bytes() / processes / GiB, force_add=True)
        # the attention a CPU run computes: model.use_flash_attention=auto is off there
        _resolve_on_cpu(checked, "model.use_flash_attention")
    result = run_preflight(checked, name=str(cfg.get("task_name", "")), suggest=True, phases=not on_host,
                           timing=not on_host)
    if on_host:
        result.budget_source = "host memory" + (f" shared by {processes} processes" if processes > 1 else "")
    return result


def _resolve_on_cpu(cfg: DictConfig, key: str) -> None:
    """Set the run-time switch ``key`` (``model.compile``, ``model.use_flash_attention``) of ``cfg`` to what a CPU
    run makes of it (``auto`` is off there)."""
    from voxdiff.models.unet import resolve_switch

    OmegaConf.update(cfg, key, resolve_switch(key, OmegaConf.select(cfg, key, default=False), "cpu"), force_add=True)
