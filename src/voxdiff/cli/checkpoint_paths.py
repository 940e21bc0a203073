"""What ``sample.py`` and ``evaluate.py`` take from a checkpoint, and what they never take from it: a path (#29).

A checkpoint is a file people download and share. The config stored in it (``voxdiff_config``) and its
hyper-parameters name folders and files of the machine that trained it: ``data.root``, ``data.cache_dir`` (with
``data.cache=disk``), ``data.out_dir`` (where ``data=mni_template`` writes its subjects), ``data.latent_dir``,
``data.stage1_checkpoint``, ``encoding.checkpoint`` (also ``system.encoding.checkpoint`` and the
hyper-parameters' ``encoding.checkpoint``), ``paths.*``, ``callbacks.*.dirpath``, ``logger.*.save_dir``,
``trainer.default_root_dir``, ``ckpt_path``. None of them decides what a command writes or reads:

* **Writing.** A command writes only under its own run directory (``paths.output_dir``): the samples, the report,
  and any cache it is asked for (``data.cache=disk`` → ``<run dir>/cache``; the MNI template's subjects →
  ``<run dir>/data``). ``paths``, callbacks, loggers and the trainer are not built from the stored config, and a
  disk cache the training run used becomes no cache (``none``). A folder to write to is not taken from the command
  line either (``data.cache_dir``, ``data.out_dir`` are refused): the run directory is the one place.
* **Reading.** The masks come from the command line: ``data.root=DIR`` (NIfTI subject folders) or
  ``data.latent_dir=DIR`` (a latent cache; latent runs). Data that needs no folder is made as the run made it: the
  built-in phantom, the packaged MNI template. The folder the checkpoint names is read only with
  ``data.from_checkpoint=true``, and only where it exists here. A latent run's stage-1 checkpoint, which encodes
  the masks and decodes the samples, likewise: ``encoding.checkpoint=PATH``, or ``encoding.from_checkpoint=true``
  for the file the checkpoint names.

Every refusal names the key, the stored path and both ways on; the command prints which data and which stage-1
weights it used (``[voxdiff] data: ...``, ``[voxdiff] stage-1 weights: ...``), and ``evaluate.py`` records them
in ``metrics.json``.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from voxdiff.checkpoint import stored_weights_path
from voxdiff.config import plain, select, voxdiff_class
from voxdiff.encodings import LearnedEncoding
from voxdiff.errors import ConfigError, boolean

#: the command's ``data.*`` keys that choose where the data comes from (not data-module settings)
CHOICE_KEYS = ("root", "latent_dir", "from_checkpoint", "cache")
#: folders a data module writes to: not taken from the command line either (the run directory is the one place)
WRITE_KEYS = ("cache_dir", "out_dir")
#: a disk cache the training run used is not written again by a command, nor read: no cache instead
_NO_DISK = {"disk": "none"}


@dataclass(frozen=True)
class PathChoice:
    """Where a command reads and writes, from its own command line (never from the checkpoint).

    Attributes:
        root: ``data.root``: NIfTI subject folders to take the masks (and images) from.
        latent_dir: ``data.latent_dir``: a latent cache to take the masks from (latent runs).
        data_from_checkpoint: ``data.from_checkpoint``: read the folder the checkpoint names, where it exists here.
        cache: ``data.cache`` (None: as trained, a disk cache becoming none).
        weights: ``encoding.checkpoint``: a latent run's stage-1 checkpoint.
        weights_from_checkpoint: ``encoding.from_checkpoint``: read the stage-1 checkpoint the checkpoint names.
        settings: the command's other ``data.*`` values (not null): they replace the stored ones.
    """

    root: str | None = None
    latent_dir: str | None = None
    data_from_checkpoint: bool = False
    cache: str | None = None
    weights: str | None = None
    weights_from_checkpoint: bool = False
    settings: dict[str, Any] = field(default_factory=dict)


def path_choice(cfg: DictConfig) -> PathChoice:
    """The :class:`PathChoice` of a ``sample.py`` / ``evaluate.py`` config, checked (nothing is read yet).

    Raises:
        ConfigError: a confirmation key that is not a boolean, a folder to write to (``data.cache_dir``,
            ``data.out_dir``), or two choices of one thing (``data.root`` with ``data.latent_dir`` or
            ``data.from_checkpoint``; ``encoding.checkpoint`` with ``encoding.from_checkpoint``).
    """
    data = {k: v for k, v in (plain(select(cfg, "data")) or {}).items() if v is not None}
    for key in WRITE_KEYS:
        if key in data:
            raise ConfigError(f"data.{key}", data[key], "a command writes only under its own run directory "
                              "(paths.output_dir)", "remove it (data.cache=disk makes its cache under the run "
                              "directory; paths.run_dir=DIR moves the run directory)")
    confirm = boolean("data.from_checkpoint", data.get("from_checkpoint", False),
                      fix="use data.from_checkpoint=true to read the folder the checkpoint names, or name one with "
                          "data.root=DIR")
    weights_confirm = boolean("encoding.from_checkpoint", select(cfg, "encoding.from_checkpoint", False) or False,
                              fix="use encoding.from_checkpoint=true to read the stage-1 checkpoint the checkpoint "
                                  "names, or name one with encoding.checkpoint=PATH")
    weights = select(cfg, "encoding.checkpoint")
    named = [f"data.{k}={data[k]}" for k in ("root", "latent_dir") if k in data]
    if len(named) > 1:
        raise ConfigError("data.latent_dir", data["latent_dir"], f"{named[0]} already names the data to read",
                          "give one of data.root and data.latent_dir")
    if named and confirm:
        raise ConfigError("data.from_checkpoint", True, f"{named[0]} already names the folder to read",
                          "drop data.from_checkpoint=true, or data.root/data.latent_dir to read the checkpoint's folder")
    if weights is not None and weights_confirm:
        raise ConfigError("encoding.from_checkpoint", True, f"encoding.checkpoint={weights} already names the "
                          "stage-1 checkpoint to read", "drop one of them")
    return PathChoice(
        root=None if "root" not in data else str(Path(str(data["root"])).expanduser()),
        latent_dir=None if "latent_dir" not in data else str(Path(str(data["latent_dir"])).expanduser()),
        data_from_checkpoint=confirm,
        cache=data.get("cache"),
        weights=None if weights is None else str(Path(str(weights)).expanduser()),
        weights_from_checkpoint=weights_confirm,
        settings={k: v for k, v in data.items() if k not in CHOICE_KEYS},
    )


def stage1_weights(encoding: Any, checkpoint: Mapping[str, Any], choice: PathChoice, ckpt: str
                   ) -> tuple[str | None, str | None]:
    """Load a latent run's stage-1 weights into its rebuilt encoding, from the file the command names
    (``encoding.checkpoint``) or, confirmed (``encoding.from_checkpoint=true``), the one the checkpoint names.

    Args:
        encoding: the rebuilt system's encoding (:func:`voxdiff.lightning.systems.rebuild_system` leaves a learned
            one without weights).
        checkpoint: the checkpoint as read.
        choice: the command's :class:`PathChoice`.
        ckpt: ``ckpt_path``, for the messages.

    Returns:
        ``(path, what)``: the weights file read and a line that says where it came from; ``(None, None)`` for a
        weight-free encoding.

    Raises:
        ConfigError: a learned encoding without a weights file chosen (naming the one the checkpoint names and both
            fixes), a confirmed file that is not here, a weights file given for a weight-free encoding, or weights
            the encoding refuses (named as ``encoding.checkpoint``).
    """
    stored = stored_weights_path(checkpoint)
    if not isinstance(encoding, LearnedEncoding):
        if choice.weights is not None or choice.weights_from_checkpoint:
            key = "encoding.checkpoint" if choice.weights is not None else "encoding.from_checkpoint"
            raise ConfigError(key, choice.weights if choice.weights is not None else True,
                              f"{ckpt} uses {encoding.label}, which reads no weights file",
                              "leave encoding.checkpoint and encoding.from_checkpoint unset")
        return None, None
    if choice.weights is not None:
        path, what = choice.weights, f"encoding.checkpoint={choice.weights}"
    elif choice.weights_from_checkpoint:
        if stored is None or not Path(stored).is_file():
            raise ConfigError("encoding.from_checkpoint", True, f"the stage-1 checkpoint {ckpt} names, "
                              f"encoding.checkpoint={stored}, is not a file here",
                              "pass encoding.checkpoint=PATH, the stage-1 checkpoint the run was trained with")
        path, what = stored, f"encoding.from_checkpoint=true: {stored}"
    else:
        raise ConfigError("encoding.checkpoint", None, f"{ckpt} is a latent diffusion checkpoint: its masks are encoded "
                          f"and its samples decoded by a stage-1 checkpoint, and it names {stored}; a checkpoint does "
                          "not choose the files a command reads",
                          "pass encoding.checkpoint=PATH (the stage-1 checkpoint the run was trained with), or "
                          f"encoding.from_checkpoint=true to read {stored}")
    encoding.load_weights(path)
    return path, what


def command_data(saved: Mapping[str, Any], choice: PathChoice, run_dir: str | Path, ckpt: str, weights: str | None,
                 fix: str) -> tuple[Any, str]:
    """The data module a command conditions on, built from the checkpoint's stored ``data`` node without its paths
    (:attr:`path_args` of the data module) and the command's :class:`PathChoice`; and a line that says which data.

    Args:
        saved: the checkpoint's stored config (``voxdiff_config``).
        choice: the command's :class:`PathChoice`.
        run_dir: the command's run directory (``paths.output_dir``): every file the data module writes lies under it.
        ckpt: ``ckpt_path``, for the messages.
        weights: the stage-1 weights :func:`stage1_weights` read (a latent cache must have been made by them).
        fix: what to do about a checkpoint without a usable data config.

    Returns:
        ``(datamodule, what)``: a :class:`~voxdiff.data.VolumeDataModule` (the phantom, a NIfTI folder, the MNI
        template's subjects made under the run directory) or a :class:`~voxdiff.data.latents.LatentDataModule`.

    Raises:
        ConfigError: no stored data config, a stored data module that is not voxdiff's, a folder the checkpoint
            names but the command did not choose, a confirmed folder that is not here, or a latent cache for a run
            on volumes.
    """
    # deferred: the data modules import Lightning (seconds at start-up); a refused config exits before
    import lightning as L

    from voxdiff.data.datamodule import VolumeDataModule
    from voxdiff.data.latents import LatentDataModule
    from voxdiff.data.mni_template import MNITemplateDataModule

    data = dict(saved.get("data") or {})
    if not data:
        raise ConfigError("ckpt_path", ckpt, "the checkpoint carries no data config (voxdiff_config)",
                          "use a checkpoint written by python train.py")
    try:
        cls, stored = voxdiff_class(data, "data", L.LightningDataModule, ("voxdiff.data",), fix)
    except ConfigError as err:
        raise ConfigError("ckpt_path", ckpt, f"its stored data config is refused ({err})", fix) from None
    path_args = getattr(cls, "path_args", None)
    if path_args is None:
        raise ConfigError("ckpt_path", ckpt, f"its stored data module {cls.__name__} does not declare which of its "
                          "arguments are paths (path_args), so none of its settings are used", fix)
    run_dir = Path(run_dir)
    named = {k: stored.pop(k) for k in path_args if k in stored}  # the training machine's: never used as they are
    stored.pop("drop_last", None)  # a command never trains: its data's training split may be smaller than a batch
    stored.update(choice.settings)
    cache = choice.cache if choice.cache is not None else _NO_DISK.get(stored.get("cache"), stored.get("cache"))

    def build(target: type, **paths: Any) -> Any:
        accepted = _arguments(target)
        unknown = sorted(k for k in choice.settings if k not in accepted)
        if unknown:
            raise ConfigError(f"data.{unknown[0]}", choice.settings[unknown[0]],
                              f"is not a setting of {target.__name__}, which this command reads",
                              f"remove it; {target.__name__} takes "
                              + ", ".join(k for k in accepted if k not in path_args))
        kwargs = {k: v for k, v in stored.items() if k in accepted}
        if issubclass(target, VolumeDataModule):
            kwargs.update(cache=cache or "memory", cache_dir=str(run_dir / "cache"))
        if issubclass(target, LatentDataModule):
            kwargs.update(masks=True, stage1_checkpoint=weights)  # the command samples from the full-size masks
        return target(**kwargs, **paths)

    def nifti(root: str, what: str) -> tuple[Any, str]:
        return build(VolumeDataModule, root=root), what

    def confirmed(key: str) -> str:
        where = named.get(key)
        if where is None or not Path(str(where)).is_dir():
            raise ConfigError("data.from_checkpoint", True, f"the folder {ckpt} names, data.{key}={where}, does not "
                              "exist here", "pass data.root=DIR, the folder of subject folders to take the masks from"
                              + (", or data.latent_dir=DIR, a latent cache" if key == "latent_dir" else ""))
        return str(where)

    if choice.latent_dir is not None and not issubclass(cls, LatentDataModule):
        raise ConfigError("data.latent_dir", choice.latent_dir, f"{ckpt} was trained on volumes, not on a latent "
                          "cache", "pass data.root=DIR, the folder of subject folders to take the masks from")
    if choice.root is not None:
        return nifti(choice.root, f"the NIfTI subjects of data.root={choice.root}")
    if issubclass(cls, LatentDataModule):
        if choice.latent_dir is not None:
            where, what = choice.latent_dir, f"the latent cache data.latent_dir={choice.latent_dir}"
        elif choice.data_from_checkpoint:
            where = confirmed("latent_dir")
            what = f"data.from_checkpoint=true: the latent cache {where}"
        else:
            stored_dir = named.get("latent_dir")
            raise ConfigError("data.latent_dir", None, f"{ckpt} was trained on the latent cache {stored_dir}; a "
                              "checkpoint does not choose the folders a command reads",
                              "pass data.latent_dir=DIR (a latent cache made by the same stage 1) or data.root=DIR "
                              f"(NIfTI subject folders), or data.from_checkpoint=true to read {stored_dir}")
        return build(cls, latent_dir=where), what
    if issubclass(cls, MNITemplateDataModule):  # made from a packaged template: no folder to read, one to write
        out_dir = run_dir / "data"
        dm = build(cls, out_dir=str(out_dir))
        return dm, f"subjects made from the {dm.template} template as trained, written under {out_dir}"
    if named.get("root") is None:
        dm = build(cls)
        return dm, f"the built-in phantom ({dm.num_subjects} subjects; the checkpoint names no data folder)"
    if choice.data_from_checkpoint:
        where = confirmed("root")
        return nifti(where, f"data.from_checkpoint=true: the NIfTI subjects of {where}")
    raise ConfigError("data.root", None, f"{ckpt} was trained on the NIfTI folder {named['root']}; a checkpoint does "
                      "not choose the folders a command reads", "pass data.root=DIR (the subject folders whose masks "
                      f"to condition on), or data.from_checkpoint=true to read {named['root']}")


def _arguments(target: type) -> list[str]:
    """The keyword arguments a data module's constructor takes, through the ``**kwargs`` it hands to its base."""
    names: list[str] = []
    for klass in target.__mro__:
        if "__init__" not in vars(klass):
            continue
        params = inspect.signature(vars(klass)["__init__"]).parameters.values()
        names += [p.name for p in params if p.name != "self" and p.name not in names
                  and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            break
    return names
