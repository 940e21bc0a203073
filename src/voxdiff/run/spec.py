"""The resolved run: what a composed config means, built once, with every configuration error found in one pass.

:func:`run_spec` reads the composed config (OmegaConf) and returns a :class:`RunSpec` of plain, validated objects:
what the run trains (``system.kind``), the encoding and the shapes it gives, the batch, the UNet's arguments
resolved for the device, the training step's recipe (diffusion, AdamW, EMA, clipping, guard), validation and
sampling, the precision, the strategy and world size, the GPU type, the ``preflight.*`` options and what the run asks
of its machines (checkpoints on disk, cached data, its length, its Slurm job). Every problem of every part is collected
before anything is raised, so a config with three mistakes is refused once, naming all three
(:class:`~voxdiff.errors.ConfigErrors`); a part that depends on a refused one (the UNet's divisibility on the
volume) is not checked on top of it.

``train.py`` and ``preflight.py`` build it once per config and hand its parts on; ``train.py`` hands the system's part
(:class:`SystemSpec`) to the Lightning system, which builds nothing from the config itself. A checkpoint stores the
run's resolved config (plain data, ``voxdiff_config``) and the system's plain hyper-parameters: ``sample.py`` and
``evaluate.py`` rebuild the run spec from the first (:func:`stored_run_spec`), a system rebuilt without it (an older
checkpoint) rebuilds its part from the second (:func:`system_spec`), through the same checks. The system, the sampler
and the preflight's stages after the spec read no config tree (``docs/architecture.md``, "Where OmegaConf stops").

The parts, in the order written here:

* :class:`Parallel` (:func:`parallel_of`): how a run is spread over GPUs (``trainer.strategy``, ``devices``,
  ``num_nodes``), :attr:`RunSpec.parallel`; what one rank of it holds is traced by :mod:`voxdiff.preflight.world`;
* :class:`Stage1Settings` (:func:`stage1_settings`): how a VQ-VAE stage 1 trains, :attr:`SystemSpec.stage1`. It checks
  ``system.vqvae``, ``.optim``, ``.loss``, ``.modalities``, ``.volume_shape`` and ``.codebook``; the architecture's
  own arguments are :func:`voxdiff.encodings.vqvae.vqvae_spec`'s;
* the UNet's rules, checked before anything is traced or built, each failure naming key, value and a fix:

  1. the volume divides by the encoding's factor (``data.volume_shape`` vs ``encoding``: the encoding's own check,
     through :func:`voxdiff.config.shapes`);
  2. every encoded spatial size divides by ``2 ** (levels - 1)`` for the UNet's levels
     (:func:`check_unet_divisibility`, with the deepest UNet that fits and the padded or cropped volume as fixes);
  3. the UNet arguments are consistent (list lengths = levels, channels divisible by ``norm_num_groups``, channels at
     attention levels divisible by ``num_head_channels``, ...) — :func:`voxdiff.models.unet_spec`;
  4. UNet in/out channels, when a config sets them, agree with the encoding and the mode (:func:`check_io_channels`);
  5. a compile mode with CUDA graphs, asked for by name, on a run that cannot replay them (:func:`check_cuda_graphs`);
  6. channels-last weights under FSDP, which flattens them (:func:`check_channels_last`);
* :class:`SystemSpec`, :class:`RunSpec` and the functions that build them (:func:`run_spec_problems` runs every
  check above with the rest). The GPU table is :mod:`voxdiff.run.gpus`.

Lightning is not imported here (the preflight runs on a login node without it).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from voxdiff.config import (
    Shapes,
    accumulated_batches,
    batch_size,
    build_encoding,
    is_phantom_data,
    model_spec,
    plain,
    processes,
    run_kind,
    runs_fsdp,
    select,
    shapes,
    strategy_kind,
    volume_shape,
)
from voxdiff.data.covariates import TABLE_NAME, CovariateEncoding, estimated_width, parse_covariates, table_width
from voxdiff.data.nifti import check_cache, readable_subjects
from voxdiff.data.phantom import check_volume_shape
from voxdiff.data.split import check_num_subjects, split_settings
from voxdiff.diffusion.guidance import check_guide_step
from voxdiff.encodings.base import AXES, Encoding, LearnedEncoding
from voxdiff.encodings.vqvae import VQVAESpec, as_list, vqvae_spec
from voxdiff.errors import ConfigError, Problems, boolean, integer, number, one_of, raise_all
from voxdiff.models import unet_io_channels
from voxdiff.models.unet import CUDAGRAPH_MODES, UNetSpec, unet_downsampling
from voxdiff.run.gpus import resolve_gpu
from voxdiff.step.optim import OptimSettings, optim_settings
from voxdiff.step.precision import Precision, accelerator_device, decide_precision
from voxdiff.step.recipe import RECIPES, ClipSettings, Recipe, clip_settings, recipe_from_config
from voxdiff.step.sampling import SamplingSettings, check_interval_steps, sampling_settings
from voxdiff.step.train_step import batch_shapes

__all__ = ["DATA_MEMORY_KEYS", "MODALITIES", "PRECISIONS", "RECONSTRUCTION_LOSSES", "Parallel", "PreflightOptions",
           "RunResources", "RunSpec", "Stage1Settings", "SystemSpec", "check_channels_last", "check_cuda_graphs",
           "check_io_channels", "check_unet_divisibility", "parallel_of", "preflight_options", "run_resources",
           "run_spec", "run_spec_problems", "stage1_settings", "stored_run_spec", "system_spec", "validate_trainer"]


@dataclass(frozen=True)
class Parallel:
    """How a run is spread over GPUs, as far as one rank's memory is concerned.

    Attributes:
        strategy: ``single`` (one process, or a strategy the preflight does not model), ``ddp`` or ``fsdp``.
        world_size: processes (GPUs) over all nodes.
        processes_per_node: processes on one node (host memory per node).
        gradient_as_bucket_view: DDP's gradients are views into its all-reduce buckets.
        bucket_cap_mb: DDP's bucket size in MiB.
    """

    strategy: str = "single"
    world_size: int = 1
    processes_per_node: int = 1
    gradient_as_bucket_view: bool = True
    bucket_cap_mb: float = 25.0

    @property
    def distributed(self) -> bool:
        """More than one process, with a strategy whose ranks the preflight traces."""
        return self.strategy != "single" and self.world_size > 1

    def describe(self) -> str:
        """``one GPU``, ``fsdp×4`` or ``ddp×2 (gradient_as_bucket_view=..., bucket_cap_mb=...)``."""
        if self.strategy == "ddp":
            return (f"ddp×{self.world_size} (gradient_as_bucket_view={str(self.gradient_as_bucket_view).lower()}, "
                    f"bucket_cap_mb={self.bucket_cap_mb:g})")
        return f"{self.strategy}×{self.world_size}" if self.distributed else "one GPU"


def parallel_of(trainer: Mapping[str, Any], device_type: str) -> Parallel:
    """The :class:`Parallel` of a plain ``trainer:`` config on ``device_type``: the strategy's kind
    (:func:`voxdiff.config.strategy_kind`: ``trainer.strategy.kind`` of ``trainer=ddp`` / ``trainer=fsdp``; a
    strategy name as Lightning registers it, ``auto`` counting as DDP with torch's defaults; others, e.g.
    ``deepspeed``, are traced as one GPU), over the processes Lightning starts (:func:`voxdiff.config.processes`)."""
    strategy = trainer.get("strategy") or "auto"
    name = strategy_kind(strategy)
    # a strategy named, not configured: Lightning's DDP, i.e. DistributedDataParallel's own default
    options = dict(strategy) if isinstance(strategy, Mapping) else {"gradient_as_bucket_view": False}
    per_node, world = processes(trainer, device_type)
    return Parallel(name if world > 1 else "single", world, per_node,
                    bool(options.get("gradient_as_bucket_view", True)), float(options.get("bucket_cap_mb", 25.0)))


#: batch keys a stage 1 trains on (``system.modalities``), and its reconstruction losses (``system.loss``)
MODALITIES = ("image", "mask")
RECONSTRUCTION_LOSSES = ("mse", "l1")


@dataclass(frozen=True)
class Stage1Settings:
    """How stage 1 trains (``configs/system/vqvae.yaml``), validated: what
    :class:`voxdiff.lightning.vqvae.VQVAESystem` is built from and saves as plain hyper-parameters.

    Attributes:
        vqvae: the architecture.
        optim: AdamW and its schedule (:class:`voxdiff.step.OptimSettings`).
        loss: ``{"reconstruction": "mse" | "l1", "quantization_weight": float}``.
        modalities: batch keys stacked into the autoencoder's batch.
        volume_shape: ``(D, H, W)`` of the training volumes (each divisible by the factor), or None.
        codebook: ``{"init_from_data": bool, "dead_code_fraction": float in [0, 1)}``.
    """

    vqvae: VQVAESpec
    optim: OptimSettings
    loss: dict[str, Any]
    modalities: tuple[str, ...]
    volume_shape: tuple[int, int, int] | None
    codebook: dict[str, Any]


def stage1_settings(
    vqvae: Mapping[str, Any],
    optim: Mapping[str, Any] | None = None,
    loss: Mapping[str, Any] | None = None,
    modalities: Sequence[str] = MODALITIES,
    volume_shape: Sequence[int] | None = None,
    codebook: Mapping[str, Any] | None = None,
) -> Stage1Settings:
    """Validate ``system.vqvae``, ``.optim``, ``.loss``, ``.modalities``, ``.volume_shape`` and ``.codebook`` of a
    stage-1 run (plain values; missing keys of ``loss`` and ``codebook`` take their defaults).

    Raises:
        ConfigError: the one problem, or :class:`~voxdiff.errors.ConfigErrors` naming every problem found.
    """
    collect = Problems()
    spec = collect(lambda: vqvae_spec(**dict(vqvae or {})))
    optim_ = collect(lambda: optim_settings(optim or {}))
    loss = {"reconstruction": "mse", "quantization_weight": 1.0, **dict(loss or {})}
    codebook = {"init_from_data": True, "dead_code_fraction": 0.03, **dict(codebook or {})}
    modalities = tuple(as_list(modalities) or ())
    if loss["reconstruction"] not in RECONSTRUCTION_LOSSES:
        collect.found.append(ConfigError("system.loss.reconstruction", loss["reconstruction"],
                                         "unknown reconstruction loss",
                                         f"use one of {', '.join(RECONSTRUCTION_LOSSES)}"))
    collect(lambda: number("system.loss.quantization_weight", loss["quantization_weight"], lo=0,
                           fix="use 1.0 (the weight of the VQ loss)"))
    if not modalities or not set(modalities) <= set(MODALITIES) or len(set(modalities)) != len(modalities):
        collect.found.append(ConfigError("system.modalities", list(modalities),
                                         f"must be distinct batch keys out of {MODALITIES}",
                                         "use [image, mask] (one shared VQ-VAE for both)"))
    collect(lambda: boolean("system.codebook.init_from_data", codebook["init_from_data"], fix="use true"))
    collect(lambda: number("system.codebook.dead_code_fraction", codebook["dead_code_fraction"], lo=0, hi=1,
                           hi_open=True, fix="use 0.03 (or 0 to turn dead-code restarts off)"))
    shape = None
    if volume_shape is not None:
        shape = collect(lambda: check_volume_shape(volume_shape, key="system.volume_shape"))
    if shape is not None:
        for axis, size in zip(("depth", "height", "width"), shape):
            if spec is not None and size % spec.factor:
                collect.found.append(ConfigError(
                    "data.volume_shape", list(shape), f"the {axis} {size} is not divisible by the VQ-VAE factor "
                    f"{spec.factor}", f"pad or crop the {axis} to a multiple of {spec.factor}"))
                break
    collect.raise_all()
    return Stage1Settings(vqvae=spec, optim=optim_, loss=loss, modalities=modalities, volume_shape=shape,
                          codebook=codebook)


def _levels(cfg: DictConfig) -> int:
    channels = plain(cfg.model.get("channels"))
    return len(channels) if isinstance(channels, (list, tuple)) else 0


def check_unet_divisibility(cfg: DictConfig, encoding: Encoding) -> None:
    levels = _levels(cfg)
    if levels < 2:
        return  # reported by check_model_arguments
    vol = volume_shape(cfg)
    need = unet_downsampling(levels)
    encoded = [s // encoding.factor for s in vol]
    for axis, size in zip(AXES, encoded):
        if size % need:
            # the deepest UNet every axis allows, and the volume padded so that this depth works
            fits = [lv for lv in range(2, levels) if all(e % unet_downsampling(lv) == 0 for e in encoded)]
            step = encoding.factor * need
            padded = [math.ceil(s / step) * step for s in vol]
            cropped = [s // step * step for s in vol]
            i = AXES.index(axis)
            options = []
            if fits:
                options.append(f"use {fits[-1]} levels (model.channels with {fits[-1]} entries)")
            options.append(f"pad the volume to {padded[i]} (data.volume_shape={padded})")
            if all(cropped) and cropped[i] != padded[i]:
                options.append(f"crop it to {cropped[i]} (data.volume_shape={cropped})")
            shape = "×".join(map(str, encoded))
            raise ConfigError(
                "data.volume_shape", list(vol),
                f"{axis} {size} of {encoding.label} ({shape}) is not divisible by {need}, which a {levels}-level "
                f"UNet needs",
                ", or ".join(options),
            )


def check_io_channels(cfg: DictConfig, encoding: Encoding) -> None:
    expected = dict(zip(("in_channels", "out_channels"), unet_io_channels(encoding, cfg.mode)))
    for key, want in expected.items():
        got = cfg.model.get(key)
        if got is not None and got != want:
            what = ("the image and mask encodings" if cfg.mode == "bravo" and key == "in_channels"
                    else "the image encoding" if cfg.mode == "bravo" else "the mask encoding")
            raise ConfigError(
                f"model.{key}", got,
                f"mode={cfg.mode} with {encoding.label} has {want} channels ({what})",
                f"remove model.{key} (it follows from the encoding and the mode) or set it to {want}",
            )


def check_cuda_graphs(cfg: DictConfig, device_type: str) -> None:
    """Refuse ``model.compile_mode`` set to a mode with CUDA graphs (``reduce-overhead``, ``max-autotune``) on a
    compiled CUDA run that cannot replay them: gradient accumulation (the next micro-batch's replay overwrites the
    gradients the previous one left in ``.grad``: torch raises when they are read) or FSDP (the graphs replay fixed
    addresses; FSDP gathers the parameters into new memory at every step). ``auto`` never takes them there
    (:func:`voxdiff.config.cuda_graphs_fit`)."""
    model = cfg.get("model") or {}
    mode, compiled = model.get("compile_mode"), model.get("compile", "auto")
    if device_type != "cuda" or mode not in CUDAGRAPH_MODES or compiled is False:
        return
    trainer = cfg.get("trainer") or {}
    accumulate = accumulated_batches(trainer)
    if accumulate != 1:
        raise ConfigError("model.compile_mode", mode, f"captures CUDA graphs, and trainer.accumulate_grad_batches="
                          f"{accumulate} keeps gradients in .grad between micro-batches, which the next replay "
                          "overwrites (torch raises when they are read)",
                          "use model.compile_mode=auto (torch's default mode for this run), or "
                          "trainer.accumulate_grad_batches=1")
    if runs_fsdp(cfg):
        raise ConfigError("model.compile_mode", mode, "captures CUDA graphs, which replay fixed memory addresses, "
                          "and FSDP gathers the parameters into new memory at every step",
                          "use model.compile_mode=auto (torch's default mode under FSDP)")


def check_channels_last(cfg: DictConfig) -> None:
    """Refuse ``model.channels_last=true`` under FSDP: it flattens each wrapped module's weights into one contiguous
    buffer and hands the convolutions views of it, so no weight can be channels-last there."""
    model = cfg.get("model") or {}
    if model.get("channels_last") is not True:
        return
    if runs_fsdp(cfg):
        raise ConfigError("model.channels_last", True, "keeps the convolution weights channels-last, and FSDP "
                          "flattens the weights into one contiguous buffer",
                          "use model.channels_last=auto (off under FSDP) or false, or trainer.strategy=ddp")


#: values of ``trainer.precision`` that Lightning accepts (an int from the command line, e.g. 32, counts too)
PRECISIONS = ("64-true", "64", "32-true", "32", "16-true", "16-mixed", "16", "bf16-true", "bf16-mixed", "bf16")


@dataclass(frozen=True)
class SystemSpec:
    """What the run's Lightning system is built from: the part of a run that its checkpoint's hyper-parameters
    determine (no data shapes, no batch, no devices).

    Attributes:
        kind: what the run trains (:data:`voxdiff.config.RUN_KINDS`: ``diffusion``, ``stage1``).
        mode: ``bravo`` (image conditioned on the mask) or ``seg`` (masks alone).
        encoding: the encoding (volumes ↔ what the UNet sees), built once.
        device_type: the device the parts are resolved for (``cuda``, ``cpu``).
        unet: the UNet's validated arguments with in/out channels, its ``auto`` switches resolved for
            ``device_type`` (a diffusion run; None for stage 1).
        recipe: the training step the system runs (a diffusion run; None for stage 1).
        sampling: validation sampling (a diffusion run; None for stage 1).
        val_timesteps: timesteps of the validation loss (a diffusion run; 0 for stage 1).
        stage1: how stage 1 trains: the VQ-VAE's architecture (also :attr:`vqvae`), optimizer, loss, modalities,
            volume, codebook (a stage-1 run; None for diffusion).
    """

    kind: str
    mode: str
    encoding: Encoding | None
    device_type: str
    unet: UNetSpec | None = None
    recipe: Recipe | None = None
    sampling: SamplingSettings | None = None
    val_timesteps: int = 0
    stage1: Stage1Settings | None = None

    @property
    def vqvae(self) -> Any:
        """The VQ-VAE's validated arguments (:class:`voxdiff.encodings.vqvae.VQVAESpec`) of a stage-1 run."""
        return None if self.stage1 is None else self.stage1.vqvae


@dataclass(frozen=True)
class PreflightOptions:
    """``preflight.*``: what the preflight plans the run for, beside the GPU type (:attr:`RunSpec.gpu`). A train
    config has none of these keys (they are added with ``+preflight.<key>=...``): all defaults.

    Attributes:
        gpu_memory_gib: the budget per GPU (None: the GPU type's memory).
        safety_margin: fits when peak x (1 + margin) + CUDA context <= budget (None: the caller's default).
        recipe: the training step traced: ``system`` (the run's own) or ``seed`` (the reference CSVs' step).
        disk_free_gib, host_memory_gib: free disk under the run directory and host memory per node to plan for
            (None: measured, or taken from the Slurm job).
        effective_batch: the samples per optimizer step the batch-size choice keeps (``data.batch_size=auto``,
            ``preflight.autofit``: batch x GPUs x ``trainer.accumulate_grad_batches``); None: not held.
        max_batch_size: the largest batch per GPU the choice tries.
    """

    gpu_memory_gib: float | None = None
    safety_margin: float | None = None
    recipe: str = "system"
    disk_free_gib: float | None = None
    host_memory_gib: float | None = None
    effective_batch: int | None = None
    max_batch_size: int = 64


#: the ``data:`` keys the preflight's resource checks read (:mod:`voxdiff.preflight.resources`: host memory of the
#: data module, the loader's rate; :mod:`voxdiff.preflight.autofit`: the training split's size)
DATA_MEMORY_KEYS = ("_target_", "volume_shape", "cache", "root", "num_subjects", "image_name", "mask_name",
                    "in_memory", "masks", "latent_dir", "val_fraction", "split_seed")


@dataclass(frozen=True)
class RunResources:
    """What the run asks of the machines beside the GPU (:mod:`voxdiff.preflight.resources`): its checkpoints on
    disk, its data in host memory, its length and its Slurm job.

    Attributes:
        run_dir: ``paths.run_dir``, where the checkpoints are written.
        best_top_k: ``callbacks.best.save_top_k`` (-1: every one), 0 without a best-checkpoint callback.
        keep_last: whether ``callbacks.last`` keeps ``last.ckpt``.
        guide_step: ``callbacks.guide.step``, after which the run keeps a guide snapshot (``guide-step<N>.ckpt``);
            None: no snapshot.
        data: the ``data:`` values of :data:`DATA_MEMORY_KEYS` (None where absent).
        masks: ``data.masks``: whether a latent batch carries its full-size mask (default true).
        num_workers, prefetch_factor: the DataLoader's workers and the batches each prepares ahead (None:
            torch's default).
        max_steps: ``trainer.max_steps`` (-1: no step limit).
        slurm: the experiment's ``slurm:`` block (over ``slurm/site.env``), None for no Slurm job.
    """

    run_dir: str = "."
    best_top_k: int = 0
    keep_last: bool = False
    guide_step: int | None = None
    data: Mapping[str, Any] | None = None
    masks: bool = True
    num_workers: int = 0
    prefetch_factor: int | None = None
    max_steps: int = -1
    slurm: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class RunSpec:
    """One run, resolved: its system's part and what the data, the devices and the GPU add. Shapes are per sample,
    without the batch axis.

    Attributes:
        system: what the Lightning system is built from (:class:`SystemSpec`); its fields are read through the
            run spec too (``spec.unet``, ``spec.recipe``, ...).
        shapes: the volume and its encoded shapes.
        batch_size: volumes per batch and process (``data.batch_size``).
        device_type: the device the spec is resolved for (``cuda``, ``cpu``): the run's own
            (``trainer.accelerator``), or the GPU the preflight predicts.
        precision: ``trainer.precision`` decided on that device (:func:`voxdiff.step.decide_precision`).
        parallel: the strategy, world size and DDP bucket options (one rank of it is what a GPU holds).
        gpu: the GPU type (:func:`voxdiff.run.gpus.resolve_gpu`) and where it came from (``preflight.gpu``,
            ``local GPU``, ``default``).
        clip: the trainer's gradient clipping (``trainer.gradient_clip_val``/``_algorithm``; None: none), as both
            systems' steps clip (a diffusion run's :attr:`recipe` holds it too).
        preflight: the ``preflight.*`` options (:class:`PreflightOptions`).
        resources: checkpoints, data, length and Slurm job (:class:`RunResources`).
    """

    system: SystemSpec
    shapes: Shapes
    batch_size: int
    device_type: str
    precision: Precision
    parallel: Parallel
    gpu: Any  # voxdiff.run.gpus.GpuSpec
    gpu_source: str
    clip: ClipSettings | None = None
    preflight: PreflightOptions = PreflightOptions()
    resources: RunResources = RunResources()

    kind = property(lambda self: self.system.kind, doc="SystemSpec.kind")
    mode = property(lambda self: self.system.mode, doc="SystemSpec.mode")
    encoding = property(lambda self: self.system.encoding, doc="SystemSpec.encoding")
    unet = property(lambda self: self.system.unet, doc="SystemSpec.unet")
    recipe = property(lambda self: self.system.recipe, doc="SystemSpec.recipe")
    sampling = property(lambda self: self.system.sampling, doc="SystemSpec.sampling")
    val_timesteps = property(lambda self: self.system.val_timesteps, doc="SystemSpec.val_timesteps")
    vqvae = property(lambda self: self.system.vqvae, doc="SystemSpec.vqvae")
    stage1 = property(lambda self: self.system.stage1, doc="SystemSpec.stage1")

    @property
    def batch(self) -> dict[str, tuple[int, ...]]:
        """A diffusion run's batch as its data module hands it over: the shapes of each tensor, the batch axis first
        (:func:`voxdiff.step.batch_shapes`)."""
        return batch_shapes(self.encoding, self.shapes.volume, self.batch_size, self.unet.covariate_dim)


def run_spec_problems(cfg: DictConfig, device_type: str | None = None) -> tuple[RunSpec | None, list[ConfigError]]:
    """The :class:`RunSpec` of ``cfg`` and every problem found building it (the spec is None when there is one).

    Args:
        cfg: a composed ``train`` (or ``preflight``) config.
        device_type: the device to resolve for (``cuda``: the GPU the preflight predicts, whose bf16 support comes
            from its type unless it is the local one); None: the run's own device (``trainer.accelerator``).

    The checks, in order: ``trainer`` (:func:`validate_trainer`); ``system.kind``; the strategy (FSDP trains a
    diffusion UNet only); the GPU type; the encoding; the volume and its encoded shapes; the batch; the precision
    on the device; then for a diffusion run the UNet's arguments, the divisibility of the encoded volume by its
    levels and its in/out channels (the rules above), the step's recipe and validation sampling;
    for a stage 1 the VQ-VAE's arguments.
    """
    collect = Problems()
    trainer = cfg.get("trainer") or {}  # read key by key: a key may interpolate Hydra's run-time values
    collect(lambda: validate_trainer(trainer))
    kind = collect(lambda: run_kind(cfg))
    predicted = device_type is not None
    device = device_type or accelerator_device(trainer.get("accelerator"))
    parallel = collect(lambda: parallel_of({k: plain(trainer.get(k)) for k in ("strategy", "devices", "num_nodes")},
                                           device))
    if kind == "stage1" and parallel is not None and runs_fsdp(cfg):
        collect.found.append(ConfigError(
            "trainer", "fsdp", "FSDP shards the diffusion UNet; the VQ-VAE stage 1 trains with one device or DDP",
            "use trainer=ddp (or trainer=gpu) for system=vqvae"))
    gpu = collect(lambda: resolve_gpu(cfg))
    encoding = collect(lambda: build_encoding(cfg))
    sizes = collect(lambda: shapes(cfg, encoding)) if encoding is not None else None
    batch = collect(lambda: batch_size(cfg))
    precision = None
    if not (predicted and device == "cuda" and gpu is None):
        # a predicted GPU answers bf16 from its type (the local GPU is asked, as the Trainer asks it)
        bf16 = gpu[0].bf16 if predicted and device == "cuda" and gpu[1] != "local GPU" else None
        precision = collect(lambda: decide_precision(plain(trainer.get("precision")), device, bf16))
    system = _system_part(cfg, kind, encoding, device, collect, shapes_ok=sizes is not None)
    if system is not None and system.sampling is not None:  # the run's callbacks: not a system's hyper-parameters
        collect(lambda: check_guide_snapshot(cfg, system.sampling))
        sampling, recipe = system.sampling, system.recipe
        if sampling.guidance_scale != 1.0 and recipe is not None and sizes is not None:
            # training's own samples are guided: within the interval at least once
            collect(lambda: check_interval_steps(
                "system.sampling.guidance_interval", sampling.guidance_interval,
                sampling.num_inference_steps or recipe.diffusion.num_inference_steps, recipe.diffusion,
                sizes.unet_output))
    clip = collect(lambda: clip_settings(select(cfg, "trainer.gradient_clip_val"),
                                         select(cfg, "trainer.gradient_clip_algorithm")))
    options = collect(lambda: preflight_options(cfg))
    resources = collect(lambda: run_resources(cfg))
    if collect.found:
        return None, collect.found
    return RunSpec(system=system, shapes=sizes, batch_size=batch, device_type=device, precision=precision,
                   parallel=parallel, gpu=gpu[0], gpu_source=gpu[1], clip=clip, preflight=options,
                   resources=resources), []


def preflight_options(cfg: DictConfig) -> PreflightOptions:
    """The ``preflight.*`` options of ``cfg`` (absent keys: defaults), validated.

    Raises:
        ConfigError: the one problem, or :class:`~voxdiff.errors.ConfigErrors` naming every problem found.
    """
    collect = Problems()

    def gib(key: str, example: str, positive: bool = True) -> float | None:
        value = select(cfg, f"preflight.{key}")
        return None if value is None else collect(lambda: number(
            f"preflight.{key}", value, lo=0, lo_open=positive, fix=f"e.g. preflight.{key}={example}"))

    options = PreflightOptions(
        gpu_memory_gib=gib("gpu_memory_gib", "80 (GiB)"), safety_margin=gib("safety_margin", "0.1", positive=False),
        recipe=collect(lambda: one_of("preflight.recipe", select(cfg, "preflight.recipe") or "system", RECIPES,
                                      fix="use system (the step train.py runs for this config) or seed (the step of "
                                          "the reference measurements)")),
        disk_free_gib=gib("disk_free_gib", "500 (GiB)", positive=False),
        host_memory_gib=gib("host_memory_gib", "256 (GiB)"),
        effective_batch=collect(lambda: None if select(cfg, "preflight.effective_batch") is None else integer(
            "preflight.effective_batch", select(cfg, "preflight.effective_batch"), minimum=1,
            fix="give the samples per optimizer step to keep, e.g. preflight.effective_batch=16, or null")),
        max_batch_size=collect(lambda: integer(
            "preflight.max_batch_size", select(cfg, "preflight.max_batch_size", 64), minimum=1,
            fix="give the largest batch per GPU to try, e.g. preflight.max_batch_size=64")))
    collect.raise_all()
    return options


def check_steps_window(value: Any) -> int:
    """``callbacks.steps_per_second.window``: steps per measurement of the steps/s on the bar (a positive integer)."""
    return integer("callbacks.steps_per_second.window", value, minimum=1, example=10)


def check_last_every(value: Any) -> int:
    """``callbacks.last.every_n_train_steps``: how often ``last.ckpt`` is written (a positive integer)."""
    return integer("callbacks.last.every_n_train_steps", value, minimum=1, example=1000)


def check_montage_every(value: Any) -> int:
    """``system.montage_every_n_epochs`` of a VQ-VAE stage 1: a reconstruction montage every this many validation
    epochs (0: never)."""
    return integer("system.montage_every_n_epochs", value, minimum=0, example=1)


def _check_callbacks(cfg: DictConfig, collect: Problems) -> None:
    """What the callbacks (and the stage-1 system's montage) check as they are built, checked before launch."""
    if OmegaConf.select(cfg, "callbacks.steps_per_second") is not None:
        collect(lambda: check_steps_window(select(cfg, "callbacks.steps_per_second.window", 10)))
    if OmegaConf.select(cfg, "callbacks.last") is not None:
        collect(lambda: check_last_every(select(cfg, "callbacks.last.every_n_train_steps", 1000)))
    if OmegaConf.select(cfg, "system.montage_every_n_epochs") is not None:
        collect(lambda: check_montage_every(select(cfg, "system.montage_every_n_epochs")))


def run_resources(cfg: DictConfig) -> RunResources:
    """The :class:`RunResources` of ``cfg``, validated.

    Raises:
        ConfigError: the one problem, or :class:`~voxdiff.errors.ConfigErrors` naming every problem found.
    """
    collect = Problems()
    best = OmegaConf.select(cfg, "callbacks.best")  # a node, unresolved: its dirpath is Hydra's run-time folder
    top_k = 0
    if best is not None:
        top_k = collect(lambda: integer("callbacks.best.save_top_k", select(cfg, "callbacks.best.save_top_k", 1),
                                        minimum=-1, fix="e.g. callbacks.best.save_top_k=1 (-1: keep every one)"))
    guide = None  # the step after which the run keeps its guide snapshot, another checkpoint on disk
    if OmegaConf.select(cfg, "callbacks.guide") is not None:
        guide = collect(lambda: check_guide_step(select(cfg, "callbacks.guide.step")))
    _check_callbacks(cfg, collect)
    workers = select(cfg, "data.num_workers", 0)
    prefetch = select(cfg, "data.prefetch_factor")
    if select(cfg, "data.cache") is not None:  # a data module without the key (latents) caches nothing
        collect(lambda: check_cache(select(cfg, "data.cache")))
    if select(cfg, "data.num_subjects") is not None:  # host memory and the batch choice count them
        collect(lambda: check_num_subjects(select(cfg, "data.num_subjects")))
    collect(lambda: split_settings(select(cfg, "data.val_fraction", 0.25), select(cfg, "data.split_seed", 0)))
    slurm = select(cfg, "slurm")
    if slurm is not None and not isinstance(slurm, Mapping):
        collect.found.append(ConfigError("slurm", slurm, "must be a mapping of slurm/site.env keys (or null: no "
                                         "Slurm job)", "e.g. slurm: {GPUS: 1, TIME: '24:00:00'} in the experiment"))
    resources = RunResources(
        run_dir=str(select(cfg, "paths.run_dir", ".")),
        best_top_k=top_k,
        keep_last=OmegaConf.select(cfg, "callbacks.last") is not None,
        guide_step=guide,
        data={k: select(cfg, f"data.{k}") for k in DATA_MEMORY_KEYS},
        masks=bool(select(cfg, "data.masks", True)),
        num_workers=collect(lambda: integer("data.num_workers", 0 if workers is None else workers, minimum=0,
                                            fix="set data.num_workers to 0 (main process) or more")),
        prefetch_factor=None if prefetch is None else collect(lambda: integer(
            "data.prefetch_factor", prefetch, minimum=1, fix="e.g. data.prefetch_factor=2")),
        max_steps=select(cfg, "trainer.max_steps", -1),
        slurm=slurm,
    )
    collect.raise_all()
    return resources


def _system_part(cfg: DictConfig, kind: str | None, encoding: Encoding | None, device: str, collect: Problems,
                 shapes_ok: bool | None) -> SystemSpec:
    """The :class:`SystemSpec` of ``cfg`` (its problems go to ``collect``). ``shapes_ok``: True, the data's shapes
    are valid and the model is checked against them (the UNet's levels, the VQ-VAE's factor); False, they were
    refused (nothing is checked on top); None, a system's own hyper-parameters (no data config: stage 1 checks the
    ``volume_shape`` it was given)."""
    mode = str(OmegaConf.select(cfg, "mode", default="bravo"))
    unet = recipe = sampling = stage1 = None
    val_timesteps = 0
    if kind == "diffusion":
        if encoding is not None:
            unet = collect(lambda: model_spec(cfg, encoding, device))
            width = collect(lambda: covariate_dim(cfg))
            if unet is not None and width:
                unet = replace(unet, covariate_dim=width)
            if unet is not None and shapes_ok:
                collect(lambda: check_unet_divisibility(cfg, encoding))
            collect(lambda: check_io_channels(cfg, encoding))
        collect(lambda: check_cuda_graphs(cfg, device))
        collect(lambda: check_channels_last(cfg))
        recipe = collect(lambda: recipe_from_config(cfg, "system"))
        mask_weight = getattr(recipe.diffusion, "mask_weight", 0.0) if recipe is not None else 0.0
        if mask_weight and isinstance(encoding, LearnedEncoding) and not select(cfg, "data.masks", True):
            collect.found.append(ConfigError(
                "data.masks", False, f"diffusion.mask_weight={mask_weight:g} weights the loss by the full-size mask, "
                "which a latent batch carries only with data.masks=true", "set data.masks=true, or "
                "diffusion.mask_weight=0"))
        if recipe is not None:
            collect(lambda: check_mask_sdf(recipe.diffusion, mode, encoding))
            if encoding is not None:
                collect(lambda: check_sigma_data(recipe.diffusion, unet_io_channels(encoding, mode)[1]))
        val_timesteps = select(cfg, "system.val_timesteps", 4)
        drop = recipe.guidance.drop_prob if recipe is not None and recipe.guidance is not None else 0.0
        sampling = collect(lambda: sampling_settings(select(cfg, "system.sampling"), val_timesteps, mode, drop))
    elif kind == "stage1":
        def get(key: str, default: Any = None) -> Any:
            return select(cfg, f"system.{key}", default)

        volume = get("volume_shape") if shapes_ok is not False else None
        if get("vqvae") is None:  # system.kind=stage1 over a diffusion system's config
            collect.found.append(ConfigError("system.kind", kind, "this system config has no system.vqvae node: it "
                                             "is not a VQ-VAE's", "train stage 1 with experiment=vqvae_4x or "
                                             "experiment=vqvae_8x, or leave system.kind as the experiment sets it"))
        else:
            stage1 = collect(lambda: stage1_settings(get("vqvae"), get("optim"), get("loss"),
                                                     get("modalities", MODALITIES), volume, get("codebook")))
    return SystemSpec(kind=kind, mode=mode, encoding=encoding, device_type=device, unet=unet, recipe=recipe,
                      sampling=sampling, val_timesteps=val_timesteps, stage1=stage1)


def check_mask_sdf(diffusion: Any, mode: str, encoding: Encoding | None) -> None:
    """``diffusion.mask_sdf_scale`` is what a mask model draws (``mode=seg``), made by a weight-free encoding
    (:func:`voxdiff.diffusion.batch.mask_distance_map`).

    Raises:
        ConfigError: naming the key, the value and a fix.
    """
    scale = getattr(diffusion, "mask_sdf_scale", None)
    if scale is None:
        return
    if mode != "seg":
        raise ConfigError("diffusion.mask_sdf_scale", scale, f"shapes what a mask model draws, and mode={mode} draws "
                          "images conditioned on the binary mask", "set diffusion.mask_sdf_scale=null, or mode=seg")
    if isinstance(encoding, LearnedEncoding):
        raise ConfigError("diffusion.mask_sdf_scale", scale, "a learned encoding (VQ-VAE) was trained on binary masks "
                          "and its latents are cached from them", "set diffusion.mask_sdf_scale=null, or train the "
                          "mask model on a weight-free encoding (encoding=haar, s2d or identity)")


def check_sigma_data(diffusion: Any, channels: int) -> None:
    """``diffusion.sigma_data`` (rectified flow's preconditioning) holds one RMS, and ``diffusion.data_mean`` one mean,
    or one per channel of what the UNet predicts (``channels``, the encoding's).

    Raises:
        ConfigError: naming the key, the value and a fix.
    """
    for key, what in (("sigma_data", "RMS"), ("data_mean", "mean")):
        values = getattr(diffusion, key, None)
        if values is not None and len(values) not in (1, channels):
            raise ConfigError(f"diffusion.{key}", list(values), f"has {len(values)} values and the UNet predicts "
                              f"{channels} channels of the encoding", f"give one {what}, or {channels} (one per "
                              "channel, in the encoding's order), or null")


def check_guide_snapshot(cfg: DictConfig, sampling: SamplingSettings) -> None:
    """A run whose commands autoguide by default (``system.sampling.autoguide_scale``) takes a guide snapshot
    (``callbacks.guide.step``, whose value :func:`run_resources` checks). (A run that ends before that step has none:
    its commands then sample without autoguidance and say so.)

    Raises:
        ConfigError: naming the key, the value and a fix.
    """
    if sampling.autoguide_scale != 1.0 and select(cfg, "callbacks.guide.step") is None:
        raise ConfigError("system.sampling.autoguide_scale", sampling.autoguide_scale, "makes sample.py and "
                          "evaluate.py autoguide with the run's guide snapshot, and callbacks.guide.step is null",
                          "set callbacks.guide.step=N (e.g. a third of trainer.max_steps), or "
                          "system.sampling.autoguide_scale=1")


def covariate_dim(cfg: DictConfig) -> int:
    """``K`` of the run's covariate vector (0: none): exact from a system's stored encoding (``system.covariates``,
    the hyper-parameter a run with covariates saves), else from ``data.covariates``
    fitted from the run's participants table where its NIfTI folder can be read here (as the data module fits it:
    :func:`voxdiff.data.covariates.table_width`), else :func:`voxdiff.data.covariates.estimated_width` (exact for
    the phantom; one entry per column of another table)."""
    stored = select(cfg, "system.covariates")
    if stored:
        return CovariateEncoding.from_plain(stored).width
    value = select(cfg, "data.covariates")
    phantom = is_phantom_data(select(cfg, "data"))
    exact = None if phantom or not parse_covariates(value) else _table_width(cfg, value)
    return estimated_width(value, phantom) if exact is None else exact


def _table_width(cfg: DictConfig, value: Any) -> int | None:
    """``K`` fitted from the run's own participants table and subjects where both can be read here (a NIfTI folder
    on this machine), else None (a latent cache: the estimate)."""
    root = select(cfg, "data.root")
    if root is None:
        return None
    folder = Path(str(root))
    subjects = readable_subjects(folder, select(cfg, "data.image_name"), select(cfg, "data.mask_name"))
    if subjects is None:  # not readable from here (another machine's path): the estimate
        return None
    table = select(cfg, "data.covariates_table") or folder / TABLE_NAME
    return table_width(value, Path(str(table)).expanduser(), subjects, float(select(cfg, "data.val_fraction", 0.25)),
                       int(select(cfg, "data.split_seed", 0)))


def system_spec(kind: str, hparams: Mapping[str, Any], device_type: str) -> SystemSpec:
    """The :class:`SystemSpec` of a Lightning system's plain hyper-parameters (what its checkpoint stores), resolved
    for ``device_type``: the same checks as :func:`run_spec`'s, on the keys the system was given.

    Args:
        kind: the system's run kind (``diffusion``: ``model``, ``encoding``, ``diffusion``, ``mode``, ``optim``,
            ``ema``, ``sampling``, ``val_timesteps``, ``guard``, ``guidance``; ``stage1``: ``vqvae``, ``optim``, ``loss``,
            ``modalities``, ``volume_shape``, ``codebook``).
        hparams: plain values (a Hydra node is converted).

    Raises:
        ConfigError: the one problem, or :class:`~voxdiff.errors.ConfigErrors` naming every problem found.
    """
    values = {k: plain(v) for k, v in hparams.items()}
    system = {k: values.get(k) for k in ("optim", "ema", "sampling", "guard", "guidance", "vqvae", "loss", "modalities",
                                          "volume_shape", "codebook", "covariates") if values.get(k) is not None}
    if values.get("val_timesteps") is not None:
        system["val_timesteps"] = values["val_timesteps"]
    cfg = OmegaConf.create({"system": system, "mode": values.get("mode") or "bravo",
                            **{k: values[k] for k in ("model", "encoding", "diffusion") if values.get(k) is not None}})
    collect = Problems()
    encoding = collect(lambda: build_encoding(cfg)) if kind == "diffusion" else None
    spec = _system_part(cfg, kind, encoding, device_type, collect, shapes_ok=None)
    collect.raise_all()
    return spec


def run_spec(cfg: DictConfig, device_type: str | None = None) -> RunSpec:
    """The :class:`RunSpec` of ``cfg`` (see :func:`run_spec_problems`).

    Raises:
        ConfigError: the one problem, or :class:`~voxdiff.errors.ConfigErrors` naming every problem found.
    """
    spec, problems = run_spec_problems(cfg, device_type)
    raise_all(problems)
    return spec


def stored_run_spec(record: Mapping[str, Any], device_type: str) -> RunSpec:
    """The :class:`RunSpec` of a run's resolved config stored as plain data (a checkpoint's ``voxdiff_config``),
    resolved for ``device_type`` (where the checkpoint is used now: the run's precision decided for it, its
    ``auto`` switches resolved there).

    Raises:
        ConfigError: the one problem, or :class:`~voxdiff.errors.ConfigErrors` naming every problem found.
    """
    return run_spec(OmegaConf.create(dict(record)), device_type)


def validate_trainer(trainer_cfg: Mapping[str, Any]) -> None:
    """Check the ``trainer:`` keys voxdiff relies on, before anything is built (plain values, resolved).

    Lightning checks some of them late (``max_steps=abc`` fails as a comparison naming only ``trainer``), some
    not at all (``gradient_clip_val=-1`` flips every gradient with voxdiff's clipping; ``max_steps=0`` trains
    nothing and exits 0).

    Raises:
        ConfigError: naming ``trainer.<key>``, the value and a fix.
    """

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
    interval = trainer_cfg.get("val_check_interval")
    if interval is not None and (isinstance(interval, bool) or not isinstance(interval, (int, float)) or interval <= 0
                                 or (isinstance(interval, float) and interval > 1)):
        raise ConfigError("trainer.val_check_interval", interval, "must be a fraction of an epoch in (0, 1] or a "
                          "number of training steps >= 1 (0 never validates)",
                          "e.g. trainer.val_check_interval=1.0 (once an epoch), or leave it out")
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
