"""Reading the files voxdiff loads — training and stage-1 checkpoints, latent-cache records — as data only.

Every ``torch.load`` of the project goes through :func:`load_file`: ``weights_only=True`` (the unpickler accepts
tensors and plain containers and nothing else, so a pickle payload in a file is refused, never run), with the
globals it needs declared in :data:`SAFE_GLOBALS`, and a one-line :class:`~voxdiff.errors.ConfigError` naming the
file, what is wrong with it and what to do — never torch's advice to retry with ``weights_only=False``.

A checkpoint is data in a second sense too: the config stored in it is never handed to Hydra's ``instantiate``
as it is. Runs are rebuilt from its plain values through voxdiff's own builders
(:func:`voxdiff.config.instantiate_voxdiff` accepts only voxdiff's own classes).
"""

from __future__ import annotations

import pickle
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch

from voxdiff.config import RUN_KINDS
from voxdiff.errors import ConfigError

#: globals the files voxdiff writes need beyond torch's weights-only defaults. None: checkpoints hold tensors,
#: numbers, strings and containers only (numpy RNG states are stored as lists, voxdiff.lightning.rng; the LR
#: schedule as its ``__dict__``). Add a class here only if a checkpoint really needs it, never a function.
SAFE_GLOBALS: tuple[Any, ...] = ()

#: where a training checkpoint keeps its run's resolved config, as plain data (the run spec's stored form,
#: :func:`voxdiff.run.spec.stored_run_spec`; written by :class:`voxdiff.lightning.callbacks.ConfigInCheckpoint`)
CONFIG_KEY = "voxdiff_config"

_ZIP_MAGIC = b"PK\x03\x04"  # torch.save writes a zip archive

#: what kind of checkpoint a file is, keyed as :func:`checkpoint_kind` returns it: the kind of run that wrote it
#: (:data:`voxdiff.config.RUN_KINDS`), or ``unknown``
KINDS = {
    "diffusion": "a diffusion-UNet checkpoint (DiffusionSystem, system=diffusion)",
    "stage1": "a VQ-VAE stage-1 checkpoint (VQVAESystem, system=vqvae)",
    "unknown": "not a checkpoint of voxdiff's train.py (no DiffusionSystem or VQVAESystem hyper-parameters in it)",
}


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


def checkpoint_kind(checkpoint: Mapping[str, Any]) -> str:
    """Which kind of run wrote a loaded checkpoint: ``"diffusion"`` or ``"stage1"`` (:data:`KINDS`,
    :data:`voxdiff.config.RUN_KINDS`), or ``"unknown"``.

    A voxdiff system records its kind in the checkpoint (``hyper_parameters.kind``, its class's ``kind``); a recorded
    kind that is not a run kind is ``unknown``. Compatibility: a checkpoint written before the kind was recorded (no
    ``kind`` among its hyper-parameters) is recognised by its structure — the diffusion system's ``model``,
    ``encoding``, ``diffusion`` and ``mode``, or the stage 1's ``vqvae``.
    """
    hparams = checkpoint.get("hyper_parameters") if isinstance(checkpoint, Mapping) else None
    if not isinstance(hparams, Mapping):
        return "unknown"
    if "kind" in hparams:
        return hparams["kind"] if hparams["kind"] in RUN_KINDS else "unknown"
    if {"model", "encoding", "diffusion", "mode"} <= set(hparams):
        return "diffusion"
    if "vqvae" in hparams:
        return "stage1"
    return "unknown"


def system_class(kind: str) -> type:
    """The Lightning system that trains a run of ``kind`` (:data:`voxdiff.config.RUN_KINDS`) and writes its
    checkpoints: the one of voxdiff's systems whose class declares that ``kind``."""
    from voxdiff.lightning.diffusion import DiffusionSystem
    from voxdiff.lightning.vqvae import VQVAESystem

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
                   device_type: str | None = None, precision: Any = None) -> Rebuilt:
    """The Lightning system of a checkpoint, rebuilt from what it stores, with its weights (and, for a diffusion
    system, its EMA weights), on the CPU in eval mode; the checkpoint itself; and its run spec.

    Never Lightning's ``load_from_checkpoint`` nor Hydra's ``instantiate`` of a stored ``_target_``: the system's
    constructor takes the stored plain values, and the encoding or data it names must be one of voxdiff's own. The
    system is built from the run spec's part, rebuilt from the run's stored config (:data:`CONFIG_KEY`,
    :func:`voxdiff.run.spec.stored_run_spec`) for ``device_type``; its architecture must be the one the
    hyper-parameters recorded. A checkpoint without a stored config (written by hand, or by a test) is rebuilt from
    its hyper-parameters alone, and its spec is None.

    Args:
        kind: the kind of checkpoint the caller needs, a run kind (``"diffusion"`` or ``"stage1"``, see
            :data:`KINDS`); the system is :func:`system_class`'s.
        device_type: the device the system will run on (``cuda``, ``cpu``): the run spec is resolved for it (e.g.
            SDPA attention on a GPU, the stored ``trainer.precision`` decided there); None: the default device.
        precision: the precision the caller runs in (its ``precision`` key), in place of the stored run's
            ``trainer.precision``; None: as trained.

    Raises:
        ConfigError: the file is unreadable, of another kind, or its stored config or weights are refused; the
            precision (as trained, or ``precision``) cannot run on ``device_type`` (naming ``precision``).
    """
    import inspect

    from voxdiff.step.precision import accelerator_device

    cls = system_class(kind)
    checkpoint = load_file(path, key, fix)
    found = checkpoint_kind(checkpoint)
    if found != kind:
        raise ConfigError(key, str(path), f"is {KINDS[found]}; this command needs {KINDS[kind]}", fix)
    hparams = checkpoint["hyper_parameters"]
    accepted = inspect.signature(cls.__init__).parameters
    args = {k: hparams[k] for k in accepted if k in hparams and k != "spec"}
    missing = [k for k, p in accepted.items() if k != "self" and p.default is p.empty and k not in args]
    if missing:  # a recorded kind without the hyper-parameters its system needs
        raise ConfigError(key, str(path), f"its hyper-parameters lack {', '.join(missing)}, which {cls.__name__} "
                          "needs", fix)
    if device_type is not None and "device_type" in accepted:
        args["device_type"] = device_type
    spec = None
    record = checkpoint.get(CONFIG_KEY)
    if "spec" in accepted and isinstance(record, Mapping) and record:
        for part in ("model", "encoding", "diffusion", "mode"):  # the system was built from the same config
            if part in hparams and hparams[part] != record.get(part):
                raise ConfigError(key, str(path), f"its hyper-parameters and its stored config ({CONFIG_KEY}) "
                                  f"disagree on {part}: {hparams[part]} vs {record.get(part)}", fix)
        spec = _stored_spec(record, device_type or accelerator_device("auto"), precision, str(path), key, fix)
        args["spec"] = spec.system
    try:
        system = cls(**args)
    except ConfigError as err:  # e.g. a stored encoding whose _target_ is not a voxdiff encoding
        raise ConfigError(key, str(path), f"its stored config is refused ({err})", fix) from None
    if spec is not None and kind == "stage1" and system.hparams["vqvae"] != hparams.get("vqvae"):
        raise ConfigError(key, str(path), f"its hyper-parameters and its stored config ({CONFIG_KEY}) disagree on "
                          f"vqvae: {hparams.get('vqvae')} vs {system.hparams['vqvae']}", fix)
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
    from voxdiff.errors import ConfigErrors
    from voxdiff.run.spec import stored_run_spec

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
