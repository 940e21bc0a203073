"""The Trainer of a run, built the same way for ``train.py``, the tests and the benchmark.

``trainer.precision`` is decided at run time by :func:`voxdiff.step.decide_precision` (null: ``bf16-mixed`` on a
CUDA GPU with bf16, ``16-mixed`` on one without, ``32-true`` on the CPU), the function the preflight and the
sampler call too. Checkpoints are written by :class:`AtomicCheckpointIO`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import LearningRateMonitor

from voxdiff.lightning.checkpoint_io import AtomicCheckpointIO
from voxdiff.step.precision import accelerator_device, cpu_has_native_bf16, decide_precision

log = logging.getLogger(__name__)


def resolve_precision(precision: Any, accelerator: Any = "auto") -> str:
    """``trainer.precision`` as Lightning takes it, decided by :func:`voxdiff.step.decide_precision` for the device
    of ``trainer.accelerator`` (raises ConfigError for a precision voxdiff does not run). ``bf16-mixed`` on a CPU
    without bf16 in hardware trains, with a warning that says it is slow and what to set instead."""
    device = accelerator_device(accelerator)
    name = decide_precision(precision, device).name
    if name == "bf16-mixed" and device == "cpu" and not cpu_has_native_bf16():
        log.warning("trainer.precision=%s on a CPU without bf16 in hardware (AVX512-BF16 or AMX): autocast emulates "
                    "it, slower than fp32. Set trainer.precision=32-true (for the demo, also data.batch_size=4: "
                    "its fp32 recipe, docs/demo_recipe.md)", precision)
    return name


def configure_cpu_threads() -> int:
    """Intra-op threads = the CPUs this process may run on (SLURM's allocation, a container's quota), divided
    among the processes of this node; ``OMP_NUM_THREADS`` wins when set. Returns the count."""
    if os.environ.get("OMP_NUM_THREADS"):
        return torch.get_num_threads()
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("SLURM_NTASKS_PER_NODE", "1")) or 1)
    threads = max(1, cpus // max(1, local))
    torch.set_num_threads(threads)
    return threads


def instantiate_callbacks(callbacks_cfg: Mapping[str, Any] | None) -> list[L.Callback]:
    """``callbacks:`` (a dict of ``_target_`` nodes; a null entry is switched off) → Lightning callbacks."""
    from hydra.utils import instantiate

    out = []
    for name, node in (callbacks_cfg or {}).items():
        if node is None:
            continue
        if "_target_" not in node:
            raise ValueError(f"callbacks.{name} has no _target_")
        out.append(instantiate(node, _convert_="all"))
    return out


def instantiate_loggers(logger_cfg: Mapping[str, Any] | None) -> Any:
    """``logger:`` (one ``_target_`` node, a mapping of them, or null) → a logger, a list of loggers, or False."""
    from hydra.utils import instantiate

    if not logger_cfg:
        return False
    if "_target_" in logger_cfg:
        return instantiate(logger_cfg, _convert_="all")
    loggers = [instantiate(node, _convert_="all") for node in logger_cfg.values() if node]
    return loggers or False


def build_trainer(
    trainer_cfg: Mapping[str, Any],
    callbacks: Sequence[L.Callback] = (),
    logger: Any = False,
    **overrides: Any,
) -> L.Trainer:
    """Instantiate ``trainer:`` (a ``_target_: lightning.Trainer`` node) with the resolved precision, the atomic
    checkpoint IO, ``callbacks`` and ``logger``. ``overrides`` replace config entries (tests, benchmark)."""
    from hydra.utils import instantiate

    callbacks = list(callbacks)
    if not logger:  # Lightning refuses a LearningRateMonitor without a logger
        callbacks = [c for c in callbacks if not isinstance(c, LearningRateMonitor)]
    accelerator = overrides.get("accelerator", trainer_cfg.get("accelerator", "auto"))
    precision = resolve_precision(overrides.pop("precision", trainer_cfg.get("precision")), accelerator)
    return instantiate(trainer_cfg, precision=precision, callbacks=callbacks, logger=logger,
                       plugins=[AtomicCheckpointIO()], _convert_="all", **overrides)


