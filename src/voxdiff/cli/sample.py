"""``python sample.py ckpt_path=PATH [n=4] [data.root=DIR] ...``: generate volumes from a training checkpoint.

compose → validate → rebuild the run spec from the config stored in the checkpoint, for this device
(:func:`voxdiff.lightning.systems.rebuild_system`) → the system from it, with the checkpoint's weights (a latent
run: and the stage-1 weights ``encoding.checkpoint=PATH`` names), on the CPU with one copy of the weights (the EMA's
written in) → its peak device memory predicted (:func:`check_memory`: the UNet, the guide's when autoguided, the
sampler's and decoder's tensors) and refused above ``memory_budget_gib`` or a GPU's free memory, naming the batch that
fits → the model (and the guide) on the device → take ``n`` masks (the validation subjects of the
data the command names: ``data.root=DIR``, a latent run's ``data.latent_dir=DIR``, the built-in phantom where the
run trained on it, or with ``data.from_checkpoint=true`` the folder the checkpoint names) → the run's sampler
(DDIM, or Euler for rectified flow; ``guidance_scale`` for classifier-free guidance, ``guidance_interval`` for the
steps either guidance runs at) with the EMA weights → decode →
NIfTI with the source affine + PNG montage per sample (with covariates: at the values ``covariates.<name>=value``
asks for, else the subject's own, written beside it as ``*_covariates.json``; :mod:`voxdiff.cli.covariate_args`),
in this run's directory (``<paths.log_dir>/sample/<time>/samples``). In seg mode it writes generated masks.
A path stored in the checkpoint never decides what is read or written (:mod:`voxdiff.cli.checkpoint_paths`): the
command writes only under its run directory and says which data and weights it used.
The precision is the trained one (``precision: null``): the checkpoint's ``trainer.precision`` decided for the
sampling device by :func:`voxdiff.step.decide_precision`, as the Trainer decided it.

Exit codes (:mod:`voxdiff.cli.exit_codes`): 0 done; 2 the config or the checkpoint was refused; 5 the data was
refused. The checkpoint is read as data (:func:`voxdiff.files.load_file`) and the run is rebuilt from its
plain values through voxdiff's own builders: a ``_target_`` stored in it is never called unless it names one of
voxdiff's own encoding or data classes.
"""

from __future__ import annotations

import functools
from pathlib import Path
from collections.abc import Sequence
from typing import Any, NamedTuple

from omegaconf import DictConfig, open_dict

from voxdiff.checkpoint import CONFIG_KEY, GUIDE_GLOB
from voxdiff.cli.checkpoint_paths import command_data, path_choice, stage1_weights
from voxdiff.cli.covariate_args import (
    covariate_points,
    covariate_rows,
    covariate_vectors,
    recorded_request,
    requested_covariates,
    without_table,
)
from voxdiff.cli.devices import check_device, pick_device
from voxdiff.cli.exit_codes import hydra_main, refusals
from voxdiff.config import AUTO_BATCH, require, select
from voxdiff.diffusion.guidance import check_autoguide_scale, check_guidance_interval
from voxdiff.encodings import LearnedEncoding
from voxdiff.errors import ConfigError, boolean, integer, number, one_of, plain
from voxdiff.step.sampling import check_interval_steps
from voxdiff.units import GiB

SPLITS = ("val", "all")
_CKPT_FIX = "point it at a training checkpoint, e.g. ckpt_path=<run dir>/checkpoints/last.ckpt"


def validate(cfg: DictConfig) -> None:
    """Static checks of a sampling config.

    Raises:
        ConfigError: naming the key, the value and a fix.
    """
    require(cfg, "ckpt_path", fix="python sample.py ckpt_path=<run dir>/checkpoints/last.ckpt")
    ckpt = cfg.get("ckpt_path")
    if ckpt is None or not Path(str(ckpt)).is_file():
        raise ConfigError("ckpt_path", ckpt, "no such checkpoint file", _CKPT_FIX)
    for key, minimum in (("n", 1), ("seed", 0)):
        integer(key, cfg.get(key), minimum=minimum, example=max(minimum, 1))
    if not batch_is_auto(cfg):
        integer("batch_size", cfg.get("batch_size"), minimum=1,
                fix="e.g. batch_size=2 (masks sampled at once), or batch_size=auto (the largest predicted to fit)")
    steps = cfg.get("num_inference_steps")
    if steps is not None:
        integer("num_inference_steps", steps, minimum=1, fix="e.g. num_inference_steps=50, or null for the run's")
    one_of("split", cfg.split, SPLITS)
    boolean("use_ema", cfg.get("use_ema"), fix="use use_ema=true (the EMA weights) or use_ema=false (the raw ones)")
    if cfg.get("guidance_scale") is not None:  # what this model can do is checked once it is loaded
        number("guidance_scale", cfg.guidance_scale, lo=0, fix="e.g. guidance_scale=2, 1 for none, or null as trained")
    if cfg.get("eta") is not None:
        number("eta", cfg.eta, lo=0, hi=1, fix="use eta=0 (deterministic DDIM or Euler) to 1, or null as trained")
    if cfg.get("autoguide_scale") is not None:  # what this run can do is checked once it is loaded
        check_autoguide_scale("autoguide_scale", cfg.autoguide_scale, null=True)
    check_guidance_interval("guidance_interval", plain(cfg.get("guidance_interval")), null=True)
    if cfg.get("unweight") is not None:  # what this model can undo is checked once it is loaded
        boolean("unweight", cfg.unweight, fix="use unweight=true (the default) or false")
    if cfg.get("memory_budget_gib") is not None:
        number("memory_budget_gib", cfg.memory_budget_gib, lo=0, lo_open=True,
               fix="e.g. memory_budget_gib=40 (GiB this command may take on its device), or null for what a GPU has "
                   "free")
    guide = cfg.get("autoguide_ckpt")
    if guide is not None and not Path(str(guide)).is_file():
        raise ConfigError("autoguide_ckpt", guide, "no such checkpoint file",
                          f"point it at a guide snapshot (<run dir>/checkpoints/{GUIDE_GLOB}), or null for the "
                          "one beside ckpt_path")
    check_device(cfg.device)
    path_choice(cfg)


class Loaded(NamedTuple):
    """What :func:`_load` returns."""

    system: Any  #: the diffusion system, on the CPU, with the weights to sample (:meth:`TrainStep.fold_ema`)
    saved: dict[str, Any]  #: the checkpoint's stored config (``voxdiff_config``)
    precision: Any  #: the precision to sample in (:class:`voxdiff.step.precision.Precision`)
    weights: str | None  #: a latent run's stage-1 weights file, as the command chose it (None: weight-free)
    spec: Any  #: the run spec (:class:`voxdiff.run.spec.RunSpec`) rebuilt for the sampling device


def _load(cfg: DictConfig, device: Any, requested: bool = True) -> Loaded:
    """The diffusion system of ``ckpt_path``, built from the run spec its stored config gives for ``device`` (which
    decides ``model.use_flash_attention=auto``), with its weights and, for a latent run, the stage-1 weights the
    command names (:func:`voxdiff.cli.checkpoint_paths.stage1_weights`; printed); the stored config; the precision to
    sample in: ``precision`` if given, else the trained ``trainer.precision`` decided for this device (by
    :func:`voxdiff.step.decide_precision`, as the Trainer decided it); and the run spec.

    The system stays on the CPU, with one copy of the weights: the EMA's written in when ``use_ema``, the raw ones
    otherwise, and no EMA (:meth:`voxdiff.step.TrainStep.fold_ema`): :func:`ready` puts it on the device.

    ``requested``: check the command's ``covariates.<name>=value`` against the covariates the checkpoint records as
    soon as it is read, before the model is built (:func:`voxdiff.cli.covariate_args.requested_covariates`).

    Raises:
        ConfigError: the checkpoint is refused, a requested covariate value is refused, the precision cannot run on
            this device (naming ``precision``), or a latent run's stage-1 weights are not named, or refused.
    """
    import torch

    # deferred: Lightning costs seconds at start-up; a refused config exits before it is imported
    from voxdiff.lightning.systems import rebuild_system

    device_type = torch.device(device).type
    system, checkpoint, spec = rebuild_system(str(cfg.ckpt_path), "diffusion", _CKPT_FIX, device_type=device_type,
                                              precision=cfg.get("precision"),
                                              check=(lambda hp: recorded_request(cfg, hp)) if requested else None)
    if spec is None:  # no run config stored: no trained precision, no validation masks
        raise ConfigError("ckpt_path", cfg.ckpt_path, "the checkpoint carries no data config (voxdiff_config)",
                          "use a checkpoint written by python train.py")
    weights, what = stage1_weights(system.encoding, checkpoint, path_choice(cfg), str(cfg.ckpt_path))
    if what is not None:
        print(f"[voxdiff] stage-1 weights: {what}", flush=True)
    window = select(cfg, "encoding.window")
    if window is not None:  # encode and decode in windows here, whatever the run did (less GPU memory)
        if not isinstance(system.encoding, LearnedEncoding):
            raise ConfigError("encoding.window", plain(window), f"{cfg.ckpt_path} uses {system.encoding.label}, "
                              "which has no encoder or decoder to run in windows", "leave encoding.window unset")
        system.encoding.use_window(window, system.encoding.window_overlap)
    system.step.fold_ema(bool(cfg.use_ema))
    return Loaded(system, checkpoint[CONFIG_KEY], spec.precision, weights, spec)


def _guide_path(cfg: DictConfig) -> Path | None:
    """``autoguide_ckpt``, else the one guide snapshot (:data:`~voxdiff.checkpoint.GUIDE_GLOB`, written in training
    by :class:`voxdiff.lightning.callbacks.GuideSnapshot`) in the folder of ``ckpt_path``; None when there is none and
    the scale is the run's own (``autoguide_scale=null``), not the command's."""
    if cfg.get("autoguide_ckpt") is not None:
        return Path(str(cfg.autoguide_ckpt))
    folder = Path(str(cfg.ckpt_path)).parent
    found = sorted(folder.glob(GUIDE_GLOB))
    if not found and cfg.get("autoguide_scale") is None:
        return None
    if len(found) != 1:
        what = f"has no guide snapshot ({GUIDE_GLOB})" if not found else \
            f"has {len(found)} guide snapshots ({', '.join(p.name for p in found)})"
        raise ConfigError("autoguide_ckpt", None, f"autoguide_scale={cfg.autoguide_scale} needs a guide, and "
                          f"{folder} {what}",
                          "name one (autoguide_ckpt=<run dir>/checkpoints/guide-step<N>.ckpt; a run takes one with "
                          "callbacks.guide.step=N), or autoguide_scale=1")
    return found[0]


def _guide(cfg: DictConfig, system: Any, sampler: Any,
           guides: dict[Path, Any] | None = None) -> tuple[Any, Any, Path | None]:
    """``(guide, sampler, path)``: the guide of autoguidance when ``sampler.autoguide_scale`` is not 1 (else None): the
    UNet of :func:`_guide_path`, on the CPU, with its EMA weights written in (``use_ema``) and nothing else of its
    run kept, refused unless it has this model's mode, encoding and weight shapes (the system's
    :meth:`~voxdiff.lightning.diffusion.DiffusionSystem.load_guide`, as training loads its guide); on the device it
    adds one copy of the UNet's weights to the sampling memory. ``guides``: the guides already loaded and checked
    against ``system`` by path (a sweep's scales share one), filled in here.
    A run that asks for autoguidance by default but ended before its guide snapshot samples without it (the sampler
    returned says so), and the command prints why.

    Raises:
        ConfigError: the command's ``autoguide_scale`` without a guide to use, or a guide of another model.
    """
    if sampler.autoguide_scale == 1.0:
        return None, sampler, None
    from dataclasses import replace

    path = _guide_path(cfg)
    if path is None:
        print(f"[voxdiff] autoguidance: this run's default scale {sampler.autoguide_scale:g} needs its guide snapshot "
              f"(callbacks.guide.step), which it never took (no {GUIDE_GLOB} beside {cfg.ckpt_path}): sampling "
              "without autoguidance", flush=True)
        return None, replace(sampler, autoguide_scale=1.0), None
    guide = guides.get(path) if guides is not None else None
    if guide is None:
        guide = system.load_guide(path, use_ema=bool(cfg.use_ema))
        if guides is not None:
            guides[path] = guide
    print(f"[voxdiff] autoguidance: scale {sampler.autoguide_scale:g}, guide {path}", flush=True)
    return guide, sampler, path


#: the most masks one chunk samples with ``batch_size=auto``
AUTO_MAX_BATCH = 64


def batch_is_auto(cfg: DictConfig) -> bool:
    """Whether the command asks for the largest batch predicted to fit (``batch_size=auto``)."""
    return str(cfg.get("batch_size")).strip().lower() == AUTO_BATCH


def check_memory(cfg: DictConfig, device: Any, spec: Any, system: Any, sampler: Any) -> Any:
    """Predict the peak device memory of sampling ``batch_size`` masks at once with ``system`` and ``sampler``
    (:func:`voxdiff.preflight.memory.predict_sampling`: the weights, the guide's when autoguided, the sampler's and
    the decoder's tensors), print it, and refuse it before anything goes to the device when it exceeds the budget:
    ``memory_budget_gib`` when set, else the free memory of a CUDA device (a CPU run without a budget is not
    refused). ``batch_size=auto`` is resolved here, written into ``cfg``: the largest batch up to ``n`` and
    :data:`AUTO_MAX_BATCH` predicted to fit the budget (on the CPU without one, the host's available memory).
    Returns the prediction.

    Raises:
        ConfigError: naming the key to change: ``batch_size`` (with the largest batch predicted to fit),
            ``autoguide_scale`` (when only sampling without the guide fits), else ``device``.
    """
    import torch

    # deferred: the prediction's tracer is only needed once a checkpoint is loaded
    from voxdiff.preflight.memory import DEFAULT_SAFETY_MARGIN, predict_sampling

    @functools.cache  # each (batch, autoguide) is traced once: the choice and the refusals ask for the same ones
    def traced(batch: int, autoguide: float) -> Any:
        return predict_sampling(spec, batch, guidance_scale=sampler.guidance_scale, autoguide_scale=autoguide,
                                num_inference_steps=sampler.num_inference_steps, encoding=system.encoding,
                                device_type=torch.device(device).type, unweight=sampler.unweights)

    def predict(batch: int, autoguide: float = sampler.autoguide_scale) -> Any:
        return traced(batch, float(autoguide))

    report, budget, where = chunk_memory(cfg, device, predict, int(cfg.n), "sampling")
    if budget is None or report.required_bytes() <= budget:
        return report
    need = (f"{report.required_bytes() / GiB:.3g} GiB with a {DEFAULT_SAFETY_MARGIN:.0%} margin "
            f"({report.describe()})")
    if sampler.autoguide_scale != 1.0 and predict(1, 1.0).required_bytes() <= budget:
        raise ConfigError("autoguide_scale", sampler.autoguide_scale, f"holds the guide's UNet beside the model "
                          f"({report.guide_bytes / GiB:.3g} GiB), and sampling is predicted to need {need} even at "
                          f"batch_size=1, more than the {where} {budget / GiB:.3g} GiB",
                          f"use autoguide_scale=1 (no guide; batch_size=1 predicted "
                          f"{predict(1, 1.0).required_bytes() / GiB:.3g} GiB), or a device with more memory")
    window = "" if not isinstance(system.encoding, LearnedEncoding) or system.encoding.window else \
        ", or encoding.window=[d,h,w] (encode and decode in windows of that many latent voxels)"
    raise ConfigError("device", plain(cfg.device), f"sampling is predicted to need {need} even at batch_size=1, "
                      f"more than the {where} {budget / GiB:.3g} GiB",
                      f"use a device with {predict(1).required_bytes() / GiB:.3g} GiB free{window}")


def chunk_memory(cfg: DictConfig, device: Any, predict: Any, n: int, what: str) -> tuple[Any, int | None, str]:
    """The memory of a command that runs ``batch_size`` of its ``n`` items at once on the device (sampling masks,
    reconstructing volumes): ``batch_size=auto`` resolved and written into ``cfg`` (the largest up to ``n`` and
    :data:`AUTO_MAX_BATCH` predicted to fit the budget, else 1), the prediction printed.

    Args:
        predict: ``batch -> report`` with ``required_bytes()`` and ``describe()`` (the safety margin included).
        what: for the messages (``"sampling"``, ``"reconstruction"``).

    Returns:
        ``(the report at the batch, the budget in bytes or None, what the budget is)``; the caller refuses a
        report above the budget, which then does not fit even at batch 1.

    Raises:
        ConfigError: naming ``batch_size`` with the largest batch predicted to fit, when one smaller fits.
    """
    # deferred: the preflight's package is imported only once a command has something to check
    from voxdiff.preflight.tracker import DEFAULT_SAFETY_MARGIN

    auto = batch_is_auto(cfg)
    batch = min(AUTO_MAX_BATCH if auto else int(cfg.batch_size), n)
    budget, where = _memory_budget(cfg, device, auto)
    if auto:
        batch = (batch if predict(batch).required_bytes() <= budget else _largest_batch(predict, batch, budget)) or 1
        with open_dict(cfg):
            cfg.batch_size = batch
        print(f"[voxdiff] batch_size=auto: {batch}, the largest of at most {min(AUTO_MAX_BATCH, n)} "
              f"predicted to fit the {where} {budget / GiB:.3g} GiB", flush=True)
    report = predict(batch)
    print(f"[voxdiff] {what} memory on {device} (predicted): {report.describe()}"
          + (f"; {where} {budget / GiB:.3g} GiB" if budget is not None else ""), flush=True)
    if budget is None or report.required_bytes() <= budget:
        return report, budget, where
    fits = _largest_batch(predict, batch, budget)
    if fits is not None:
        raise ConfigError("batch_size", batch, f"{what} is predicted to need {report.required_bytes() / GiB:.3g} "
                          f"GiB with a {DEFAULT_SAFETY_MARGIN:.0%} margin ({report.describe()}), more than the "
                          f"{where} {budget / GiB:.3g} GiB", f"use batch_size={fits} (predicted "
                          f"{predict(fits).required_bytes() / GiB:.3g} GiB)")
    return report, budget, where


def _largest_batch(predict: Any, batch: int, budget: int) -> int | None:
    """The largest batch below ``batch`` whose prediction (``predict(b).required_bytes()``) fits ``budget``, or
    None when batch 1 does not: the straight line through batch 1 and ``batch`` gives the first guess (a chunk's
    tensors grow with it, the weights do not), then each guess is predicted until one fits."""
    one = predict(1).required_bytes()
    if one > budget:
        return None
    per_mask = (predict(batch).required_bytes() - one) / max(batch - 1, 1)
    b = batch - 1 if per_mask <= 0 else max(1, min(batch - 1, int((budget - one) / per_mask) + 1))
    while b > 1 and predict(b).required_bytes() > budget:
        b -= 1
    return b


def _memory_budget(cfg: DictConfig, device: Any, auto: bool = False) -> tuple[int | None, str]:
    """``(bytes, what they are)``: ``memory_budget_gib`` when set, else what a CUDA device has free now, else, to
    choose an ``auto`` batch on the CPU, the host's available memory; else ``(None, "")`` (a CPU run without a
    budget is not refused)."""
    import torch

    set_to = cfg.get("memory_budget_gib")
    if set_to is not None:
        return int(float(set_to) * GiB), "budget (memory_budget_gib)"
    if torch.device(device).type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0]), f"free memory of the {torch.cuda.get_device_name(device)}"
    if auto:
        return available_host_bytes(), "available host memory"
    return None, ""


def available_host_bytes() -> int:
    """Host memory this process can still take: ``MemAvailable`` of ``/proc/meminfo`` (Linux), within the machine's
    memory or its cgroup's limit (a container, a Slurm allocation: :func:`voxdiff.preflight.resources.
    host_memory_bytes`), whichever is lower; that limit alone where ``/proc/meminfo`` does not say."""
    # deferred: the preflight's package is imported only once a command has something to check
    from voxdiff.preflight.resources import host_memory_bytes

    limit = host_memory_bytes()
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return min(int(line.split()[1]) * 1024, limit)
    except (OSError, ValueError, IndexError):
        pass
    return limit


class Ready(NamedTuple):
    """What :func:`ready` returns."""

    system: Any  #: the diffusion system on the device, with the weights to sample
    sampler: Any  #: the sampler (:class:`voxdiff.step.sampling.SamplerChoice`)
    guide: Any  #: the guide's UNet on the device, or None without autoguidance
    guide_path: Path | None  #: its checkpoint
    saved: dict[str, Any]  #: the checkpoint's stored config
    precision: Any  #: the precision to sample in
    weights: str | None  #: a latent run's stage-1 weights file
    memory: Any  #: the predicted memory (:class:`voxdiff.preflight.memory.SamplingReport`)


def checked(cfg: DictConfig, device: Any, requested: bool = True, sampler: Any = None,
            loaded: Loaded | None = None, guides: dict[Path, Any] | None = None) -> Ready:
    """Everything a command samples with, checked for ``device`` but not yet on it: the system of ``ckpt_path``
    (:func:`_load`, or ``loaded``: what it returned for a config with the same checkpoint, data and precision), its
    sampler with the command's settings (or ``sampler``, already chosen), the guide (:func:`_guide`, from ``guides``
    where it holds it), the predicted memory (:func:`check_memory`).

    Raises:
        ConfigError: as :func:`_load`, :func:`_guide` and :func:`check_memory`, or a sampler setting the model
            cannot take.
    """
    if loaded is None:
        loaded = _load(cfg, device, requested)
    system = loaded.system
    if sampler is None:
        sampler = system.sampler(cfg.get("num_inference_steps"), cfg.get("eta"), cfg.get("guidance_scale"),
                                 cfg.get("autoguide_scale"), cfg.get("guidance_interval"), cfg.get("unweight"))
    guide, sampler, path = _guide(cfg, system, sampler, guides)
    if sampler.guided:
        check_interval_steps("guidance_interval" if cfg.get("guidance_interval") is not None
                             else "system.sampling.guidance_interval", sampler.guidance_interval,
                             sampler.num_inference_steps, system.process.settings, loaded.spec.shapes.unet_output)
    memory = check_memory(cfg, device, loaded.spec, system, sampler)
    return Ready(system, sampler, guide, path, loaded.saved, loaded.precision, loaded.weights, memory)


def check_each(cfgs: Sequence[DictConfig], device: Any) -> list[Any]:
    """:func:`checked` for each of ``cfgs``, which share the checkpoint, its data and precision and differ in how
    they sample (a guidance sweep's scales), the checkpoint read and its system built once (a 2.7B model's load is
    tens of seconds), and each guide once: each scale's guide, sampler and memory checked before anything is
    sampled. Returns each config's sampler (:class:`~voxdiff.step.sampling.SamplerChoice`).

    Raises:
        ConfigError: as :func:`checked`, for the first config refused.
    """
    loaded, guides = _load(cfgs[0], device), {}
    samplers = [checked(cfg, device, loaded=loaded, guides=guides).sampler for cfg in cfgs]
    release(loaded.system, *guides.values())
    return samplers


def ready(cfg: DictConfig, device: Any, requested: bool = True, sampler: Any = None) -> Ready:
    """:func:`checked`, then the model and the guide on the device.

    Raises:
        ConfigError: as :func:`checked`.
    """
    prepared = checked(cfg, device, requested, sampler)
    start_measuring(device)
    return prepared._replace(system=prepared.system.to(device),
                             guide=None if prepared.guide is None else prepared.guide.to(device))


def start_measuring(device: Any) -> None:
    """On a CUDA device, reset the peak that :func:`measured_memory` reads (before the weights go there)."""
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def measured_memory(device: Any, predicted: Any, what: str = "sampling") -> int | None:
    """On a CUDA device, the peak ``torch.cuda.max_memory_allocated`` since :func:`start_measuring`, printed beside
    the predicted peak (``predicted``: a :class:`voxdiff.preflight.memory.SamplingReport` or a
    :class:`voxdiff.preflight.stage1.ReconstructionReport`); None elsewhere."""
    import torch

    if torch.device(device).type != "cuda":
        return None
    measured = torch.cuda.max_memory_allocated(device)
    print(f"[voxdiff] {what} memory on {device}: measured peak {measured / GiB:.3g} GiB, predicted "
          f"{predicted.peak / GiB:.3g} GiB ({measured / predicted.peak - 1:+.1%})", flush=True)
    return measured


def _datamodule(saved: dict[str, Any], cfg: DictConfig, weights: str | None = None) -> tuple[Any, str]:
    """The data module the command conditions on, and which data it is (printed): from the command line and the
    stored config without its paths (:func:`voxdiff.cli.checkpoint_paths.command_data`)."""
    dm, what = command_data(saved, path_choice(cfg), cfg.paths.output_dir, str(cfg.ckpt_path), weights, _CKPT_FIX)
    print(f"[voxdiff] data: {what}", flush=True)
    return dm, what


def sample(cfg: DictConfig) -> list[Path]:
    """Load, generate and write; returns the montage paths."""
    import torch
    from torch.utils.data import ConcatDataset, DataLoader, Subset

    # deferred: Lightning costs seconds at start-up; a refused config exits before it is imported
    from voxdiff.lightning.samples import save_samples
    from voxdiff.lightning.trainer import configure_cpu_threads

    configure_cpu_threads()
    device = pick_device(cfg.device)
    system, sampler, guide, _, saved, precision, weights, memory = ready(cfg, device)
    encoding = system.covariate_encoding
    requested = requested_covariates(cfg, encoding, lists=True)
    points = covariate_points(requested)  # one per value of a covariate given as a list: the same noise at each
    dm, _ = _datamodule(without_table(saved, encoding, requested), cfg, weights)
    dm.setup("fit")
    dataset = dm.val_dataset if cfg.split == "val" else ConcatDataset([dm.val_dataset, dm.train_dataset])
    n = min(int(cfg.n), len(dataset))
    if n < int(cfg.n):
        print(f"[voxdiff] only {n} subjects in split={cfg.split}; sampling {n}", flush=True)
    loader = DataLoader(Subset(dataset, list(range(n))), batch_size=int(cfg.batch_size), shuffle=False)
    out_dir = Path(cfg.paths.output_dir) / "samples"
    print(f"[voxdiff] {system.mode} samples from {cfg.ckpt_path} ({sampler.describe()}, EMA: {cfg.use_ema}) into "
          f"{out_dir}", flush=True)
    pngs: list[Path] = []
    for i, batch in enumerate(loader):
        for suffix, request in points:
            # each batch's noise is seeded by its index alone: every value of a list draws the same noise
            generator = torch.Generator(device=device).manual_seed(int(cfg.seed) * 1_000_003 + i)
            rows = covariate_rows(encoding, getattr(dm, "covariate_values", {}), batch["subject"], request)
            with precision.autocast():
                generated = system.generate(batch["mask"], num_inference_steps=sampler.num_inference_steps,
                                            generator=generator, use_ema=bool(cfg.use_ema), eta=sampler.eta,
                                            guidance_scale=sampler.guidance_scale, batch_size=int(cfg.batch_size),
                                            covariates=covariate_vectors(encoding, rows), guide=guide,
                                            autoguide_scale=sampler.autoguide_scale,
                                            guidance_interval=sampler.guidance_interval,
                                            unweight=sampler.unweights)
            pngs += save_samples(out_dir, f"sample_{suffix}" if suffix else "sample", system.mode, generated.cpu(),
                                 batch["mask"], batch.get("image"), batch["affine"], batch["subject"], covariates=rows)
            print(f"[voxdiff] {len(pngs)}/{n * len(points)}: {pngs[-1]}", flush=True)
    measured_memory(device, memory)
    return pngs


def release(*modules: Any) -> None:
    """Move ``modules`` (a system, a guide; None is skipped) back to the CPU and hand their device memory back to
    the driver, so that what runs next on the device (the feature extractors, a second model) has it."""
    import torch

    for module in modules:
        if module is not None:
            module.to("cpu")
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@hydra_main("sample")
def main(cfg: DictConfig) -> None:
    """The ``voxdiff-sample`` / ``python sample.py`` entry point."""
    with refusals():
        validate(cfg)
        sample(cfg)


if __name__ == "__main__":
    main()
