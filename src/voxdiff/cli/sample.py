"""``python sample.py ckpt_path=PATH [n=4] [data.root=DIR] ...``: generate volumes from a training checkpoint.

compose → validate → rebuild the run spec from the config stored in the checkpoint, for this device
(:func:`voxdiff.lightning.systems.rebuild_system`) → the system from it, with the checkpoint's weights (a latent
run: and the stage-1 weights ``encoding.checkpoint=PATH`` names) → take ``n`` masks (the validation subjects of the
data the command names: ``data.root=DIR``, a latent run's ``data.latent_dir=DIR``, the built-in phantom where the
run trained on it, or with ``data.from_checkpoint=true`` the folder the checkpoint names) → the run's sampler
(DDIM, or Euler for rectified flow; ``guidance_scale`` for classifier-free guidance) with the EMA weights → decode →
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

from pathlib import Path
from typing import Any, NamedTuple

from omegaconf import DictConfig

from voxdiff.checkpoint import CONFIG_KEY, GUIDE_GLOB, weights_differences
from voxdiff.cli.checkpoint_paths import command_data, path_choice, stage1_weights
from voxdiff.cli.covariate_args import (
    covariate_rows,
    covariate_vectors,
    recorded_request,
    requested_covariates,
    without_table,
)
from voxdiff.cli.devices import check_device, pick_device
from voxdiff.cli.exit_codes import hydra_main, refusals
from voxdiff.config import require, select
from voxdiff.diffusion.guidance import check_autoguide_scale
from voxdiff.encodings import LearnedEncoding
from voxdiff.errors import ConfigError, boolean, integer, number, one_of, plain

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
    for key, minimum in (("n", 1), ("batch_size", 1), ("seed", 0)):
        integer(key, cfg.get(key), minimum=minimum, example=max(minimum, 1))
    steps = cfg.get("num_inference_steps")
    if steps is not None:
        integer("num_inference_steps", steps, minimum=1, fix="e.g. num_inference_steps=50, or null for the run's")
    one_of("split", cfg.split, SPLITS)
    boolean("use_ema", cfg.get("use_ema"), fix="use use_ema=true (the EMA weights) or use_ema=false (the raw ones)")
    if cfg.get("guidance_scale") is not None:  # what this model can do is checked once it is loaded
        number("guidance_scale", cfg.guidance_scale, lo=0, fix="e.g. guidance_scale=2, 1 for none, or null as trained")
    if cfg.get("eta") is not None:
        number("eta", cfg.eta, lo=0, hi=1, fix="use eta=0 (deterministic DDIM) to 1, or null as trained")
    if cfg.get("autoguide_scale") is not None:  # what this run can do is checked once it is loaded
        check_autoguide_scale("autoguide_scale", cfg.autoguide_scale, null=True)
    guide = cfg.get("autoguide_ckpt")
    if guide is not None and not Path(str(guide)).is_file():
        raise ConfigError("autoguide_ckpt", guide, "no such checkpoint file",
                          f"point it at a guide snapshot (<run dir>/checkpoints/{GUIDE_GLOB}), or null for the "
                          "one beside ckpt_path")
    check_device(cfg.device)
    path_choice(cfg)


class Loaded(NamedTuple):
    """What :func:`_load` returns."""

    system: Any  #: the diffusion system, on the sampling device, with its (EMA) weights
    saved: dict[str, Any]  #: the checkpoint's stored config (``voxdiff_config``)
    precision: Any  #: the precision to sample in (:class:`voxdiff.step.precision.Precision`)
    weights: str | None  #: a latent run's stage-1 weights file, as the command chose it (None: weight-free)


def _load(cfg: DictConfig, device: Any, requested: bool = True) -> Loaded:
    """The diffusion system of ``ckpt_path``, built from the run spec its stored config gives for ``device`` (which
    decides ``model.use_flash_attention=auto``), with its (EMA) weights and, for a latent run, the stage-1 weights
    the command names (:func:`voxdiff.cli.checkpoint_paths.stage1_weights`; printed); the stored config; and the
    precision to sample in: ``precision`` if given, else the trained ``trainer.precision`` decided for this device (by
    :func:`voxdiff.step.decide_precision`, as the Trainer decided it).

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
    return Loaded(system.to(device), checkpoint[CONFIG_KEY], spec.precision, weights)


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


def _guide(cfg: DictConfig, device: Any, system: Any, sampler: Any) -> tuple[Any, Any, Path | None]:
    """``(guide, sampler, path)``: the guide of autoguidance when ``sampler.autoguide_scale`` is not 1 (else None): the
    UNet of :func:`_guide_path`, on ``device``, with its EMA weights written in (``use_ema``), refused unless it has
    this model's mode, encoding and weight shapes; it adds one copy of the UNet's weights (and, for a latent run, of
    the stage-1 model) to the sampling memory.
    A run that asks for autoguidance by default but ended before its guide snapshot samples without it (the sampler
    returned says so), and the command prints why.

    Raises:
        ConfigError: the command's ``autoguide_scale`` without a guide to use, or a guide of another model.
    """
    if sampler.autoguide_scale == 1.0:
        return None, sampler, None
    from dataclasses import replace

    from omegaconf import OmegaConf

    path = _guide_path(cfg)
    if path is None:
        print(f"[voxdiff] autoguidance: this run's default scale {sampler.autoguide_scale:g} needs its guide snapshot "
              f"(callbacks.guide.step), which it never took (no {GUIDE_GLOB} beside {cfg.ckpt_path}): sampling "
              "without autoguidance", flush=True)
        return None, replace(sampler, autoguide_scale=1.0), None
    guide = _load(OmegaConf.merge(cfg, {"ckpt_path": str(path)}), device, requested=False).system
    differences = weights_differences(system.step.model.state_dict(), {"state_dict": guide.step.model.state_dict()})
    if (guide.mode, guide.encoding.label) != (system.mode, system.encoding.label) or differences:
        raise ConfigError("autoguide_ckpt", str(path), f"is another model (mode {guide.mode}, "
                          f"{guide.encoding.label}) than {cfg.ckpt_path} (mode {system.mode}, {system.encoding.label}) "
                          f"or has other weights{f' ({differences})' if differences else ''}: a guide is the same "
                          "network, less trained",
                          f"use the guide snapshot of the same run (its checkpoints/{GUIDE_GLOB})")
    if bool(cfg.use_ema) and guide.step.ema is not None:
        guide.step.ema.copy_to(guide.step.model)
    print(f"[voxdiff] autoguidance: scale {sampler.autoguide_scale:g}, guide {path}", flush=True)
    return guide.step.model, sampler, path


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
    system, saved, precision, weights = _load(cfg, device)
    sampler = system.sampler(cfg.get("num_inference_steps"), cfg.get("eta"), cfg.get("guidance_scale"),
                             cfg.get("autoguide_scale"))
    guide, sampler, _ = _guide(cfg, device, system, sampler)
    encoding = system.covariate_encoding
    requested = requested_covariates(cfg, encoding)
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
        generator = torch.Generator(device=device).manual_seed(int(cfg.seed) * 1_000_003 + i)
        rows = covariate_rows(encoding, getattr(dm, "covariate_values", {}), batch["subject"], requested)
        with precision.autocast():
            generated = system.generate(batch["mask"], num_inference_steps=sampler.num_inference_steps,
                                        generator=generator, use_ema=bool(cfg.use_ema), eta=sampler.eta,
                                        guidance_scale=sampler.guidance_scale, batch_size=int(cfg.batch_size),
                                        covariates=covariate_vectors(encoding, rows), guide=guide,
                                        autoguide_scale=sampler.autoguide_scale)
        pngs += save_samples(out_dir, "sample", system.mode, generated.cpu(), batch["mask"], batch.get("image"),
                             batch["affine"], batch["subject"], covariates=rows)
        print(f"[voxdiff] {len(pngs)}/{n}: {pngs[-1]}", flush=True)
    return pngs


@hydra_main("sample")
def main(cfg: DictConfig) -> None:
    """The ``voxdiff-sample`` / ``python sample.py`` entry point."""
    with refusals():
        validate(cfg)
        sample(cfg)


if __name__ == "__main__":
    main()
