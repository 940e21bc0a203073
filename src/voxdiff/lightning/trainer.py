"""The Trainer of a run, built the same way for ``train.py``, the tests and the benchmark.

``trainer.precision`` is decided at run time by :func:`voxdiff.step.decide_precision` (null: ``bf16-mixed`` on a
CUDA GPU with bf16, ``16-mixed`` on one without, ``32-true`` on the CPU), the function the preflight and the
sampler call too. Checkpoints are written by :class:`AtomicCheckpointIO`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import LearningRateMonitor

from voxdiff.lightning.checkpoint_io import AtomicCheckpointIO
from voxdiff.step.precision import accelerator_device, decide_precision


def resolve_precision(precision: Any, accelerator: Any = "auto") -> str:
    """``trainer.precision`` as Lightning takes it, decided by :func:`voxdiff.step.decide_precision` for the device
    of ``trainer.accelerator`` (raises ConfigError for a precision voxdiff does not run)."""
    return decide_precision(precision, accelerator_device(accelerator)).name


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


#: values of ``trainer.precision`` that Lightning accepts (an int from the command line, e.g. 32, counts too)
PRECISIONS = ("64-true", "64", "32-true", "32", "16-true", "16-mixed", "16", "bf16-true", "bf16-mixed", "bf16")


def validate_trainer(trainer_cfg: Mapping[str, Any]) -> None:
    """Check the ``trainer:`` keys voxdiff relies on, before anything is built (plain values, resolved).

    Lightning checks some of them late (``max_steps=abc`` fails as a comparison naming only ``trainer``), some
    not at all (``gradient_clip_val=-1`` flips every gradient with voxdiff's clipping; ``max_steps=0`` trains
    nothing and exits 0).

    Raises:
        ConfigError: naming ``trainer.<key>``, the value and a fix.
    """
    from voxdiff.errors import ConfigError, integer, number, one_of

    def whole(key: str, minimum: int, fix: str, allow: tuple[Any, ...] = ()) -> None:
        value = trainer_cfg.get(key)
        if value in allow and not isinstance(value, bool):
            return
        integer(f"trainer.{key}", value, minimum=minimum, fix=fix)

    for key, text in (("max_steps", "trainer.max_steps=1000, or -1 for no step limit"),
                      ("max_epochs", "trainer.max_epochs=100, or -1 for no epoch limit")):
        value = trainer_cfg.get(key)
        if value == 0 and not isinstance(value, bool):
            raise ConfigError(f"trainer.{key}", 0, "trains nothing (the run would end before its first step "
                              "and exit 0)", f"e.g. {text}")
        whole(key, 1, f"e.g. {text}", allow=(-1, None) if key == "max_epochs" else (-1,))
    clip = trainer_cfg.get("gradient_clip_val")
    if clip is not None:  # a negative value would flip every gradient
        number("trainer.gradient_clip_val", clip, lo=0, lo_open=True,
               fix="e.g. trainer.gradient_clip_val=1.0, or trainer.gradient_clip_val=null for no clipping")
    algorithm = trainer_cfg.get("gradient_clip_algorithm")
    if algorithm is not None:
        one_of("trainer.gradient_clip_algorithm", algorithm, ("norm", "value"))
    whole("accumulate_grad_batches", 1, "e.g. trainer.accumulate_grad_batches=1 (a positive integer)")
    whole("log_every_n_steps", 1, "e.g. trainer.log_every_n_steps=10", allow=(None,))
    whole("check_val_every_n_epoch", 1, "e.g. trainer.check_val_every_n_epoch=1", allow=(None,))
    whole("num_sanity_val_steps", -1, "e.g. trainer.num_sanity_val_steps=2 (0: none, -1: all)", allow=(None,))
    whole("num_nodes", 1, "e.g. trainer.num_nodes=1", allow=(None,))
    limit = trainer_cfg.get("limit_val_batches")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, (int, float)) or limit < 0
                              or (isinstance(limit, float) and limit > 1)):
        raise ConfigError("trainer.limit_val_batches", limit, "must be a fraction in [0, 1] or a number of batches",
                          "e.g. trainer.limit_val_batches=1.0")
    _validate_strategy(trainer_cfg.get("strategy"))
    precision = trainer_cfg.get("precision")
    if precision is not None and str(precision) not in PRECISIONS:
        raise ConfigError("trainer.precision", precision, "is not a precision Lightning knows",
                          "use null (bf16-mixed on a GPU, 32-true on the CPU), bf16-mixed or 32-true")


def _validate_strategy(strategy: Any) -> None:
    """``trainer.strategy``: the settings of voxdiff's DDP and FSDP nodes (``configs/trainer/ddp.yaml``,
    ``fsdp.yaml``) that DDP or Lightning would take without complaint or reject late."""
    from voxdiff.config import strategy_kind
    from voxdiff.errors import ConfigError, boolean, number

    if not isinstance(strategy, Mapping):
        return
    if strategy_kind(strategy) == "fsdp" and strategy.get("save_distributed_checkpoint"):
        raise ConfigError("trainer.strategy.save_distributed_checkpoint", strategy["save_distributed_checkpoint"],
                          "voxdiff writes one checkpoint file, gathered on rank 0 (about 16 bytes per parameter of "
                          "host memory while it is written); its resume, ckpt_path=auto, sample.py and evaluate.py "
                          "do not read a folder of shards", "remove it (false is the default)")
    view = strategy.get("gradient_as_bucket_view")
    if view is not None:
        boolean("trainer.strategy.gradient_as_bucket_view", view,
                fix="use true (gradients are views into DDP's buckets: one copy less)")
    cap = strategy.get("bucket_cap_mb")
    if cap is not None:
        number("trainer.strategy.bucket_cap_mb", cap, lo=0, lo_open=True,
               fix="e.g. trainer.strategy.bucket_cap_mb=25 (MiB, torch's default)")
