"""The Lightning system of each run kind, and a system rebuilt from its checkpoint.

:func:`system_class` maps a run kind (:data:`voxdiff.config.RUN_KINDS`) to the system that trains it and writes its
checkpoints; :func:`rebuild_system` rebuilds that system from a checkpoint for ``sample.py`` and ``evaluate.py``
(never Lightning's ``load_from_checkpoint`` nor Hydra's ``instantiate`` of a stored ``_target_``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

from voxdiff.checkpoint import (
    CONFIG_KEY,
    KINDS,
    checkpoint_kind,
    non_finite_tensor,
    weights_differences,
    without_weights_path,
)
from voxdiff.errors import ConfigError, ConfigErrors
from voxdiff.files import load_file
from voxdiff.lightning.diffusion import DiffusionSystem
from voxdiff.lightning.vqvae import VQVAESystem
from voxdiff.run.spec import stored_run_spec
from voxdiff.step.precision import accelerator_device

__all__ = ["Rebuilt", "rebuild_system", "system_class"]


def system_class(kind: str) -> type:
    """The Lightning system that trains a run of ``kind`` (:data:`voxdiff.config.RUN_KINDS`) and writes its
    checkpoints: the one of voxdiff's systems whose class declares that ``kind``."""
    systems = {cls.kind: cls for cls in (DiffusionSystem, VQVAESystem)}
    if kind not in systems:
        raise ValueError(f"kind must be one of {', '.join(systems)}, not {kind!r}")
    return systems[kind]


class Rebuilt(NamedTuple):
    """What :func:`rebuild_system` returns."""

    system: Any  #: the Lightning system, with its weights, on the CPU in eval mode
    checkpoint: dict[str, Any]  #: the checkpoint as read
    spec: Any  #: the run spec rebuilt from the stored config (:class:`voxdiff.run.spec.RunSpec`), or None


def rebuild_system(path: str | Path, kind: str, fix: str, key: str = "ckpt_path",
                   device_type: str | None = None, precision: Any = None,
                   check: Callable[[Mapping[str, Any]], None] | None = None) -> Rebuilt:
    """The Lightning system of a checkpoint, rebuilt from what it stores, with its weights (and, for a diffusion
    system, its EMA weights), on the CPU in eval mode; the checkpoint itself; and its run spec.

    Never Lightning's ``load_from_checkpoint`` nor Hydra's ``instantiate`` of a stored ``_target_``: the system's
    constructor takes the stored plain values, and the encoding or data it names must be one of voxdiff's own. The
    system is built from the run spec's part, rebuilt from the run's stored config (:data:`CONFIG_KEY`,
    :func:`voxdiff.run.spec.stored_run_spec`) for ``device_type``; its architecture must be the one the
    hyper-parameters recorded. A checkpoint without a stored config (written by hand, or by a test) is rebuilt from
    its hyper-parameters alone, and its spec is None.

    A path stored in the checkpoint is not followed: the weights file of a learned encoding (a latent run's stage-1
    checkpoint, ``encoding.checkpoint``) is taken out of what the system is built from, so the system's encoding has
    no weights until the caller loads the ones its user named (:meth:`voxdiff.encodings.LearnedEncoding.load_weights`;
    :func:`voxdiff.checkpoint.stored_weights_path` says which file the checkpoint names).

    Args:
        kind: the kind of checkpoint the caller needs, a run kind (``"diffusion"`` or ``"stage1"``, see
            :data:`KINDS`); the system is :func:`system_class`'s.
        device_type: the device the system will run on (``cuda``, ``cpu``): the run spec is resolved for it (e.g.
            SDPA attention on a GPU, the stored ``trainer.precision`` decided there); None: the default device.
        precision: the precision the caller runs in (its ``precision`` key), in place of the stored run's
            ``trainer.precision``; None: as trained.
        check: called with the checkpoint's hyper-parameters as soon as the file is read and of ``kind``, before
            its weights are scanned or anything is built: a caller's refusal that needs only what the checkpoint
            records (e.g. a covariate value outside the range it was trained on) comes first.

    Raises:
        ConfigError: the file is unreadable, of another kind, or its stored config or weights are refused; the
            precision (as trained, or ``precision``) cannot run on ``device_type`` (naming ``precision``).
    """
    cls = system_class(kind)
    checkpoint = load_file(path, key, fix)
    found = checkpoint_kind(checkpoint)
    if found != kind:
        raise ConfigError(key, str(path), f"is {KINDS[found]}; this command needs {KINDS[kind]}", fix)
    if check is not None:
        check(checkpoint.get("hyper_parameters") or {})
    bad = non_finite_tensor(checkpoint)
    if bad is not None:
        raise ConfigError(key, str(path), f"its weight {bad} holds NaN or infinite values", fix)
    hparams = checkpoint["hyper_parameters"]
    accepted = inspect.signature(cls.__init__).parameters
    args = {k: hparams[k] for k in accepted if k in hparams and k != "spec"}
    missing = [k for k, p in accepted.items() if k != "self" and p.default is p.empty and k not in args]
    if missing:  # a recorded kind without the hyper-parameters its system needs
        raise ConfigError(key, str(path), f"its hyper-parameters lack {', '.join(missing)}, which {cls.__name__} "
                          "needs", fix)
    if device_type is not None and "device_type" in accepted:
        args["device_type"] = device_type
    if "encoding" in args:  # the stage-1 weights file the checkpoint names is the caller's to choose
        args["encoding"] = without_weights_path(args["encoding"])
    spec = None
    record = checkpoint.get(CONFIG_KEY)
    if "spec" in accepted and isinstance(record, Mapping) and record:
        for part in ("model", "encoding", "diffusion", "mode"):  # the system was built from the same config
            # (but for the weights file they name, which neither decides)
            if part in hparams and without_weights_path(hparams[part]) != without_weights_path(record.get(part)):
                raise ConfigError(key, str(path), f"its hyper-parameters and its stored config ({CONFIG_KEY}) "
                                  f"disagree on {part}: {hparams[part]} vs {record.get(part)}", fix)
        spec = _stored_spec(without_weights_path(record), device_type or accelerator_device("auto"), precision,
                            str(path), key, fix)
        args["spec"] = spec.system
    try:
        system = cls(**args)
    except ConfigError as err:  # e.g. a stored encoding whose _target_ is not a voxdiff encoding
        raise ConfigError(key, str(path), f"its stored config is refused ({err})", fix) from None
    if spec is not None and kind == "stage1" and system.hparams["vqvae"] != hparams.get("vqvae"):
        raise ConfigError(key, str(path), f"its hyper-parameters and its stored config ({CONFIG_KEY}) disagree on "
                          f"vqvae: {hparams.get('vqvae')} vs {system.hparams['vqvae']}", fix)
    diff = weights_differences(system.state_dict(), checkpoint)
    if diff is not None:
        raise ConfigError(key, str(path), f"its weights do not match its stored config ({diff})", fix)
    if hasattr(system, "on_load_checkpoint"):
        system.on_load_checkpoint(checkpoint)  # the diffusion system's EMA weights
    try:
        system.load_state_dict(checkpoint.get("state_dict") or {})
    except RuntimeError as err:
        reason = str(err).strip().splitlines()[0]
        raise ConfigError(key, str(path), f"its weights do not match its stored config ({reason})", fix) from None
    return Rebuilt(system.eval(), checkpoint, spec)


def _stored_spec(record: Mapping[str, Any], device_type: str, precision: Any, path: str, key: str, fix: str) -> Any:
    """The run spec of a checkpoint's stored config for ``device_type``, run in ``precision`` (None: as trained)."""
    record = dict(record)
    if precision is not None:
        record["trainer"] = {**(record.get("trainer") or {}), "precision": precision}
    try:
        return stored_run_spec(record, device_type)
    except ConfigError as err:
        problems = err.problems if isinstance(err, ConfigErrors) else [err]
        for problem in problems:
            if problem.key == "trainer.precision":
                requested = precision if precision is not None else problem.value
                raise ConfigError("precision", requested, f"cannot run on {device_type}: {problem.problem}",
                                  "set precision=32-true, or one this device runs (null: as trained)") from None
        raise ConfigError(key, path, f"its stored config is refused ({err})", fix) from None
