"""Where configuration becomes objects: compose the Hydra configs, build the encoding and the UNet.

The train, preflight and sample entry points and the tests all go through these functions, so a config is
interpreted one way only. OmegaConf containers are converted to plain Python here, at the boundary.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from voxdiff.encodings.base import Encoding
from voxdiff.errors import ConfigError, int_list, integer, plain  # noqa: F401 - plain: voxdiff.config.plain too
from voxdiff.models.unet import UNetSpec, build_unet_from_spec, unet_io_channels, unet_spec

#: model-config keys that are not arguments of the UNet
_MODEL_META_KEYS = ("_target_", "_partial_", "_convert_", "_recursive_")


def cpu_or(cpu_value: Any, gpu_value: Any) -> Any:
    """The ``${voxdiff.cpu_or:CPU,GPU}`` resolver: ``CPU`` on a machine without a CUDA GPU, else ``GPU``.

    Gives CPU-sized defaults (a short smoke run) and GPU-sized ones from one config, e.g.
    ``max_steps: ${voxdiff.cpu_or:20,-1}``. Registered when :mod:`voxdiff.config` is imported. It is evaluated
    where the config is resolved; ``VOXDIFF_TARGET=gpu`` (or ``cpu``) forces one side, e.g. to resolve a GPU
    run's config on a machine without a GPU (preflight).
    """
    target = os.environ.get("VOXDIFF_TARGET", "").lower()
    if target in ("gpu", "cpu"):
        return gpu_value if target == "gpu" else cpu_value
    import torch

    return gpu_value if torch.cuda.is_available() else cpu_value


@contextmanager
def resolved_for(target: str) -> Iterator[None]:
    """Inside the block, ``${voxdiff.cpu_or:...}`` resolves as on ``target`` (``gpu`` or ``cpu``), unless
    ``VOXDIFF_TARGET`` is set already (the caller's choice stands); after it, the environment is as it was. The
    preflight resolves a GPU run's config on a machine without one this way: set for good, the variable would make
    every later config of the process (a test's training run) resolve as a GPU run's."""
    before = os.environ.get("VOXDIFF_TARGET")
    if before is None:
        os.environ["VOXDIFF_TARGET"] = target
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("VOXDIFF_TARGET", None)


def job_run_id(prefix: str, default: str | None = None) -> str | None:
    """The ``${voxdiff.job_run_id:PREFIX[,DEFAULT]}`` resolver: ``PREFIX-<SLURM_JOB_ID>`` inside a Slurm job, else
    ``DEFAULT`` (None if not given).

    A requeued job keeps its job id, so its logger continues the same run (wandb ``id``, CSV ``version``).
    """
    job = os.environ.get("SLURM_JOB_ID")
    return f"{prefix}-{job}" if job else default


if not OmegaConf.has_resolver("voxdiff.cpu_or"):
    OmegaConf.register_new_resolver("voxdiff.cpu_or", cpu_or)
def run_id(prefix: str, run_dir: str) -> str:
    """The ``${voxdiff.run_id:PREFIX,RUN_DIR}`` resolver (wandb's run id): ``PREFIX-<SLURM_JOB_ID>`` inside a Slurm
    job, else ``PREFIX-<8 hex digits of the run directory's absolute path>``. A requeued job and a resume into the
    same run directory continue one wandb run; two runs in different directories never share one (a fixed id
    would make ``wandb sync`` merge every run of a task into one)."""
    import hashlib

    digest = hashlib.sha1(str(Path(run_dir).resolve()).encode()).hexdigest()[:8]
    return job_run_id(prefix) or f"{prefix}-{digest}"


if not OmegaConf.has_resolver("voxdiff.job_run_id"):
    OmegaConf.register_new_resolver("voxdiff.job_run_id", job_run_id)
if not OmegaConf.has_resolver("voxdiff.run_id"):
    OmegaConf.register_new_resolver("voxdiff.run_id", run_id)


def config_dir() -> Path:
    """The ``configs/`` folder: ``$VOXDIFF_CONFIG_DIR`` if set, else the repository's (voxdiff installs editable)."""
    env = os.environ.get("VOXDIFF_CONFIG_DIR")
    path = Path(env) if env else Path(__file__).resolve().parents[2] / "configs"
    if not (path / "train.yaml").is_file():
        raise FileNotFoundError(
            f"no voxdiff configs at {path}; install voxdiff from its repository (pip install -e .) "
            "or set VOXDIFF_CONFIG_DIR to the repository's configs/ folder"
        )
    return path


def compose(config_name: str = "train", overrides: Sequence[str] = ()) -> DictConfig:
    """Compose a config as the command line would (``python train.py a=b ...``), outside ``@hydra.main``.

    ``hydra:`` interpolations (the run directory) are resolved as in a real run.
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        return hydra_compose(config_name=config_name, overrides=list(overrides), return_hydra_config=True)


def is_phantom_data(data: Any) -> bool:
    """Whether a ``data:`` config (a Hydra node or its plain dict; None: none) serves the built-in phantom: the
    volume data module without a ``root``."""
    data = plain(data) or {}
    return data.get("root") is None and str(data.get("_target_", "")).endswith("VolumeDataModule")


def select(cfg: Any, key: str, default: Any = None) -> Any:
    """The value at the dotted ``key`` of ``cfg`` as plain Python (resolved), or ``default`` where it is absent."""
    return plain(OmegaConf.select(cfg, key, default=default))


def volume_shape(cfg: DictConfig) -> tuple[int, int, int]:
    """``data.volume_shape`` as a validated (D, H, W) tuple."""
    return int_list("data.volume_shape", select(cfg, "data.volume_shape"), length=3,  # type: ignore[return-value]
                    fix="give three positive sizes D, H, W, e.g. data.volume_shape=[160,128,128]")


#: ``data.batch_size=auto``: ``train.py`` and ``preflight.py`` let the preflight choose it
#: (:mod:`voxdiff.preflight.autofit`) before anything else reads the config
AUTO_BATCH = "auto"


def batch_size_is_auto(cfg: DictConfig) -> bool:
    """Whether ``cfg`` asks the preflight to choose its batch size (``data.batch_size=auto``)."""
    return str(select(cfg, "data.batch_size")).strip().lower() == AUTO_BATCH


def batch_size(cfg: DictConfig) -> int:
    """``data.batch_size`` as a validated positive integer (volumes per batch and GPU); never guessed here (``auto``
    is resolved by ``train.py``/``preflight.py`` before the config is read)."""
    value = select(cfg, "data.batch_size")
    fix = "set data.batch_size to 1 or more (volumes per batch and GPU), e.g. data.batch_size=1"
    if str(value).strip().lower() == AUTO_BATCH:
        fix = "give a number here; data.batch_size=auto is resolved by train.py and preflight.py only"
    return integer("data.batch_size", value, minimum=1, fix=fix + (", or auto (train.py and preflight.py choose it)"
                                                                   if "auto" not in fix else ""))


#: what a run trains (``system.kind``): the diffusion UNet, or the stage 1 of a learned encoding (the VQ-VAE)
RUN_KINDS = ("diffusion", "stage1")


def run_kind(cfg: DictConfig) -> str:
    """What ``cfg`` trains, one of :data:`RUN_KINDS`: every command dispatches on it.

    ``system.kind`` (set in ``configs/system/*.yaml``); a system config without it (written before the key
    existed) gets the ``kind`` its class declares (``DiffusionSystem.kind``, ``VQVAESystem.kind``), the class looked
    up from ``system._target_`` among voxdiff's own Lightning systems only.

    Raises:
        ConfigError: ``system.kind`` is not a known kind, or the class declares none.
    """
    fix = (f"set system.kind to one of {'|'.join(RUN_KINDS)} (configs/system/diffusion.yaml: diffusion, "
           "vqvae.yaml: stage1)")
    kind = OmegaConf.select(cfg, "system.kind", default=None)
    if kind is None:
        from lightning import LightningModule

        cls = target_class(OmegaConf.select(cfg, "system._target_", default=None), "system", LightningModule,
                           ("voxdiff.lightning",), fix)
        kind = getattr(cls, "kind", None)
    if kind not in RUN_KINDS:
        raise ConfigError("system.kind", kind, "is not a kind of run voxdiff trains", fix)
    return kind


#: how a run's strategy spreads the model over its processes (``trainer.strategy.kind``): one device's way, DDP
#: replicas, FSDP shards
PARALLEL_KINDS = ("single", "ddp", "fsdp")


def strategy_kind(strategy: Any) -> str:
    """What ``trainer.strategy`` does with the model on several processes, one of :data:`PARALLEL_KINDS`.

    voxdiff's strategy nodes declare it (``kind:`` in ``configs/trainer/ddp.yaml``, ``fsdp.yaml``). A node without
    it (written before the key existed): the ``kind`` its class declares (voxdiff's strategies) or the Lightning
    strategy it derives from (``FSDPStrategy``, ``ModelParallelStrategy``: fsdp; ``DDPStrategy``: ddp, but
    DeepSpeed's). A name: the class Lightning's ``StrategyRegistry`` holds under it; ``auto`` (or none) is DDP, which
    Lightning picks for several devices. Anything else (DeepSpeed, a class outside voxdiff and Lightning) is traced
    as ``single``.

    Raises:
        ConfigError: ``trainer.strategy.kind`` is not one of :data:`PARALLEL_KINDS`.
    """
    strategy = plain(strategy)
    if isinstance(strategy, dict):
        kind = strategy.get("kind")
        if kind is not None:
            if kind not in PARALLEL_KINDS:
                raise ConfigError("trainer.strategy.kind", kind, "is not a kind of strategy voxdiff models",
                                  f"use one of {'|'.join(PARALLEL_KINDS)} (trainer=ddp: ddp, trainer=fsdp: fsdp)")
            return kind
        target = str(strategy.get("_target_", ""))
        if not target.startswith(("voxdiff.lightning.", "lightning.")):
            return "single"
        import importlib

        module, _, name = target.rpartition(".")
        cls = getattr(importlib.import_module(module), name, None)
    else:
        name = str(strategy or "auto").lower()
        if name == "auto":
            return "ddp"
        from lightning.pytorch.strategies import StrategyRegistry

        cls = StrategyRegistry[name]["strategy"] if name in StrategyRegistry else None
    if not isinstance(cls, type):
        return "single"
    if getattr(cls, "kind", None) in PARALLEL_KINDS:
        return cls.kind
    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy

    if issubclass(cls, (FSDPStrategy, ModelParallelStrategy)):
        return "fsdp"
    return "ddp" if issubclass(cls, DDPStrategy) and not issubclass(cls, DeepSpeedStrategy) else "single"


def runs_fsdp(cfg: Any) -> bool:
    """Whether the run's ``trainer.strategy`` is FSDP (:func:`strategy_kind`): it flattens the weights into one buffer
    per wrapped unit (no weight is channels-last there) and gathers them into new memory at every step (no CUDA
    graph can replay them)."""
    return strategy_kind((cfg.get("trainer") or {}).get("strategy")) == "fsdp"


def check_kind(cls: type, kind: str | None, key: str = "system") -> None:
    """A system's or strategy's ``kind`` argument (``system.kind``, ``trainer.strategy.kind``) must be the kind
    its class declares (``cls.kind``).

    Raises:
        ConfigError: naming ``<key>.kind``, the value and the class's kind.
    """
    if kind is not None and kind != cls.kind:
        raise ConfigError(f"{key}.kind", kind, f"{cls.__name__} is of kind {cls.kind}",
                          f"set {key}.kind={cls.kind} (or remove it)")


def instantiate_config(node: Any, **kwargs: Any) -> Any:
    """Hydra's ``instantiate`` of the user's own config, with voxdiff's refusals (:class:`ConfigError`,
    ``DataError``) raised as themselves instead of wrapped in Hydra's ``InstantiationException``."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    try:
        return instantiate(node, **kwargs)
    except InstantiationException as err:
        cause = err.__cause__
        if isinstance(cause, ValueError) and type(cause).__module__.startswith("voxdiff."):
            raise cause from None
        raise


def require(cfg: DictConfig, *keys: str, fix: str) -> None:
    """Refuse a mandatory value (``???`` in the config) that the command line did not give.

    Raises:
        ConfigError: naming the first missing key and ``fix`` (the command line that gives it).
    """
    for key in keys:
        if OmegaConf.is_missing(cfg, key):
            raise ConfigError(key, "???", "is required", fix)


def check_name(key: str, value: Any) -> str:
    """A name that becomes a folder of the run directory (``task_name``): a plain name, no path in it.

    Raises:
        ConfigError: a path separator, ``.``/``..`` or an empty name (the run would land outside ``paths.log_dir``).
    """
    name = str(value) if value is not None else ""
    if not name.strip() or name in (".", "..") or "/" in name or "\\" in name or (os.altsep and os.altsep in name):
        raise ConfigError(key, value, "must be a plain name without a path separator: the run directory is "
                          f"<paths.log_dir>/<{key}>/..., so a path in it puts the run elsewhere",
                          f"use a plain name, e.g. {key}=exp11_lr2e-4 (paths.run_dir=DIR sets the folder itself)")
    return name


def voxdiff_class(node: Any, key: str, base: type, packages: Sequence[str], fix: str) -> tuple[type, dict]:
    """The class and keyword arguments of a ``_target_`` node, only when the target is one of voxdiff's own classes.

    A config stored in a checkpoint is data: it must not name ``builtins.open`` or ``torch.load`` and have them
    called. The target must be a subclass of ``base`` defined in one of ``packages`` (``voxdiff.encodings``,
    ``voxdiff.data``), only those modules are imported to look it up, nested ``_target_`` nodes are refused, and
    the other keys become keyword arguments.

    Raises:
        ConfigError: naming ``<key>._target_`` (or the nested node), the value and ``fix``.
    """
    values = plain(node)
    if not isinstance(values, dict):
        raise ConfigError(key, values, "must be a config node with a _target_", fix)
    target = values.get("_target_")
    _check_target(target, key, base, packages, fix)
    nested = _nested_target(values, key, top=True)
    if nested:
        raise ConfigError(nested, values, "holds a nested _target_, which is never instantiated", fix)
    cls = target_class(target, key, base, packages, fix)
    unknown = sorted(k for k in values if k.startswith("_") and k not in _MODEL_META_KEYS)
    if unknown:
        raise ConfigError(f"{key}.{unknown[0]}", values[unknown[0]], "is not a setting voxdiff reads", fix)
    return cls, {k: v for k, v in values.items() if k not in _MODEL_META_KEYS}


def _check_target(target: Any, key: str, base: type, packages: Sequence[str], fix: str) -> None:
    module = str(target).rpartition(".")[0]
    if not isinstance(target, str) or not any(module == p or module.startswith(p + ".") for p in packages):
        raise ConfigError(f"{key}._target_", target, f"is not one of voxdiff's {base.__name__} classes "
                          f"(only {', '.join(p + '.*' for p in packages)} are built)", fix)


def target_class(target: Any, key: str, base: type, packages: Sequence[str], fix: str) -> type:
    """The class a ``_target_`` string names, only when it is a subclass of ``base`` defined in one of ``packages``
    (only those modules are imported to look it up); nothing is instantiated.

    Raises:
        ConfigError: naming ``<key>._target_``, the value and ``fix``.
    """
    import importlib

    _check_target(target, key, base, packages, fix)
    module, _, name = target.rpartition(".")
    cls = getattr(importlib.import_module(module), name, None)
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise ConfigError(f"{key}._target_", target, f"is not a {base.__name__} class", fix)
    return cls


def _nested_target(value: Any, path: str, top: bool = False) -> str | None:
    if isinstance(value, dict):
        if "_target_" in value and not top:
            return f"{path}._target_"
        for k, v in value.items():
            found = _nested_target(v, f"{path}.{k}")
            if found:
                return found
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            found = _nested_target(v, f"{path}[{i}]")
            if found:
                return found
    return None


def encoding_configs(base: type = Encoding) -> list[str]:
    """The names of ``configs/encoding/*.yaml`` whose class is a ``base`` (all: :class:`Encoding`; those of learned
    encodings: :class:`~voxdiff.encodings.LearnedEncoding`), sorted."""
    names = []
    for path in sorted((config_dir() / "encoding").glob("*.yaml")):
        target = OmegaConf.load(path).get("_target_")
        try:
            target_class(target, "encoding", base, ("voxdiff.encodings",), "")
        except ConfigError:
            continue
        names.append(path.stem)
    return names


def build_encoding(cfg: DictConfig) -> Encoding:
    """Build ``cfg.encoding`` (an :class:`~voxdiff.encodings.Encoding`; only voxdiff's own encoding classes)."""
    cls, kwargs = voxdiff_class(cfg.encoding, "encoding", Encoding, ("voxdiff.encodings",),
                                f"use one of configs/encoding/*.yaml: encoding={'|'.join(encoding_configs())}")
    return cls(**kwargs)


@dataclass(frozen=True)
class Shapes:
    """What the UNet sees for one config. Shapes are per sample, without the batch axis."""

    volume: tuple[int, int, int]  # (D, H, W) of the volume
    image_encoded: tuple[int, int, int, int]  # (C, d, h, w) of the image encoding
    unet_input: tuple[int, int, int, int]  # (C_in, d, h, w): image ⊕ mask encodings in bravo mode
    unet_output: tuple[int, int, int, int]  # (C_out, d, h, w)


def shapes(cfg: DictConfig, encoding: Encoding | None = None) -> Shapes:
    """Encoded shapes of ``cfg``'s volume under its encoding and mode (checks divisibility by the factor)."""
    encoding = encoding if encoding is not None else build_encoding(cfg)
    vol = volume_shape(cfg)
    image = encoding.encoded_shape((1, *vol))
    c_in, c_out = unet_io_channels(encoding, cfg.mode)
    return Shapes(vol, image, (c_in, *image[1:]), (c_out, *image[1:]))


def model_spec(cfg: DictConfig, encoding: Encoding | None = None, device_type: str | None = None) -> UNetSpec:
    """Validated UNet arguments of ``cfg.model``, with in/out channels from the encoding and the mode; with
    ``device_type`` (``cuda``, ``cpu``: where the model will run) its ``auto`` switches resolved
    (:meth:`UNetSpec.for_device`), else left as configured."""
    encoding = encoding if encoding is not None else build_encoding(cfg)
    c_in, c_out = unet_io_channels(encoding, cfg.mode)
    args = {k: v for k, v in plain(cfg.model).items() if k not in _MODEL_META_KEYS}
    unknown = set(args) - set(UNetSpec.__dataclass_fields__) - {"in_channels", "out_channels", "covariate_dim"}
    if unknown:
        key = sorted(unknown)[0]
        raise ConfigError(f"model.{key}", args[key], "is not an argument of the UNet",
                          f"remove it; the UNet takes {', '.join(f for f in UNetSpec.__dataclass_fields__)}")
    args.update(in_channels=c_in, out_channels=c_out)
    spec = unet_spec(**args)
    if device_type is None:
        return spec
    return spec.for_device(device_type, cuda_graphs_fit(cfg, device_type), flat_weights=runs_fsdp(cfg))


#: ``trainer.devices`` values that ask Lightning for every device of the node (``auto`` is Lightning's default)
EVERY_DEVICE = (-1, "-1", "auto")


def devices_per_node(devices: Any, device_type: str) -> int:
    """The processes Lightning starts on each node for ``trainer.devices`` on ``device_type`` (``cuda`` or ``cpu``),
    read as Lightning reads it: a count (an integer, or a string of digits), a list or a comma-separated string of
    GPU ids (as many processes as ids); -1, ``"-1"`` or ``auto``: on a GPU every GPU visible here
    (``torch.cuda.device_count()``, what Lightning counts on the node the run starts on), on the CPU ``auto`` is one;
    unset (null: a system rebuilt from a checkpoint has no ``trainer:``) is one, ``configs/trainer``'s default.

    Raises:
        ConfigError: naming ``trainer.devices``: every GPU asked for where none is visible (the preflight on a
            machine without the run's GPUs: the count is not guessed), -1 on the CPU, 0, or not a device count.
    """
    if devices is None:
        return 1
    fix = "give the number of GPUs per node, e.g. trainer.devices=4 (or a list of GPU ids, trainer.devices=[0,1])"
    shown = plain(devices)
    if isinstance(devices, bool):
        raise ConfigError("trainer.devices", shown, "is not a device count", fix)
    text = devices.strip().lower() if isinstance(devices, str) else devices
    if text in EVERY_DEVICE:
        if device_type != "cuda":
            if text in (-1, "-1"):
                raise ConfigError("trainer.devices", shown, "asks for every GPU, and this run is on the CPU, where "
                                  "Lightning needs a count of processes", "e.g. trainer.devices=1 on the CPU")
            return 1
        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if visible == 0:
            raise ConfigError("trainer.devices", shown, "means every GPU of the machine the run starts on, and none "
                              "is visible here to count (a preflight on a login node?)",
                              f"{fix}; or run the preflight where the GPUs are (slurm/*.slurm runs it in the job)")
        return visible
    ids = [part.strip() for part in text.split(",") if part.strip()] if isinstance(text, str) else []
    if isinstance(text, (list, tuple)):
        count = len(text)  # those GPU ids
    elif isinstance(text, int):
        count = text  # the first N GPUs
    elif isinstance(text, str) and text.isdigit():
        count = int(text)  # "3": as the integer
    elif isinstance(text, str) and "," in text and ids and all(i.isdigit() for i in ids):
        count = len(ids)  # "0,1": those GPU ids
    else:
        raise ConfigError("trainer.devices", shown, "is not a device count", fix)
    if count < 1:
        raise ConfigError("trainer.devices", shown, "starts no process", fix)
    return count


def processes(trainer: Any, device_type: str) -> tuple[int, int]:
    """``(per node, in all)``: the processes of a run with this ``trainer:`` config on ``device_type``
    (:func:`devices_per_node`, times ``num_nodes``).

    Raises:
        ConfigError: naming ``trainer.devices`` (:func:`devices_per_node`) or ``trainer.num_nodes``.
    """
    per_node = devices_per_node(trainer.get("devices", 1), device_type)
    nodes = integer("trainer.num_nodes", trainer.get("num_nodes") or 1, minimum=1, fix="e.g. trainer.num_nodes=1")
    return per_node, per_node * nodes


def accumulated_batches(trainer: Any) -> int:
    """``trainer.accumulate_grad_batches`` of a ``trainer:`` config: the batches whose gradients one optimizer step
    sums (unset or null: 1).

    Raises:
        ConfigError: not a positive integer (as :func:`voxdiff.run.spec.validate_trainer` says first).
    """
    return integer("trainer.accumulate_grad_batches", trainer.get("accumulate_grad_batches") or 1, minimum=1,
                   fix="e.g. trainer.accumulate_grad_batches=1 (a positive integer)")


def cuda_graphs_fit(cfg: DictConfig, device_type: str) -> bool:
    """Whether ``model.compile_mode=auto`` takes CUDA graphs for this run on ``device_type``: one process (replays
    across ranks, DDP's buckets and FSDP's regathered parameters are unmeasured or cannot work) and no gradient
    accumulation (a replay overwrites the gradients the previous micro-batch left in ``.grad``; torch raises on the
    access)."""
    trainer = cfg.get("trainer") or {}
    one_process = processes({k: plain(trainer.get(k)) for k in ("devices", "num_nodes")}, device_type)[1] == 1
    return one_process and accumulated_batches(trainer) == 1


def build_model(cfg: DictConfig, encoding: Encoding | None = None, preserve_rng_state: bool = True, *,
                device_type: str):
    """Build the UNet of ``cfg`` for a run on ``device_type`` (call under ``torch.device("meta")`` to build it at no
    cost; the preflight passes ``cuda``: its meta tensors stand for a GPU)."""
    return build_unet_from_spec(model_spec(cfg, encoding, device_type), preserve_rng_state=preserve_rng_state)
