"""``python sample.py ckpt_path=PATH [n=4] ...``: generate volumes from a training checkpoint.

compose → validate → rebuild the run spec from the config stored in the checkpoint, for this device
(:func:`voxdiff.lightning.systems.rebuild_system`) → the system from it, with the checkpoint's weights → take ``n``
masks (the validation subjects of the data config saved in the checkpoint, or ``data.root=DIR``) → the run's sampler
(DDIM, or Euler for rectified flow; ``guidance_scale`` for classifier-free guidance) with the EMA weights → decode →
NIfTI with the source affine + PNG montage per sample,
in this run's directory (``<paths.log_dir>/sample/<time>/samples``). In seg mode it writes generated masks.
The precision is the trained one (``precision: null``): the checkpoint's ``trainer.precision`` decided for the
sampling device by :func:`voxdiff.step.decide_precision`, as the Trainer decided it.

Exit codes (:mod:`voxdiff.cli.exit_codes`): 0 done; 2 the config or the checkpoint was refused; 5 the data was
refused. The checkpoint is read as data (:func:`voxdiff.files.load_file`) and the run is rebuilt from its
plain values through voxdiff's own builders: a ``_target_`` stored in it is never called unless it names one of
voxdiff's own encoding or data classes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig

from voxdiff.checkpoint import CONFIG_KEY
from voxdiff.cli.devices import check_device, pick_device
from voxdiff.cli.exit_codes import refusals
from voxdiff.config import config_dir, plain, require, voxdiff_class
from voxdiff.errors import ConfigError, boolean, integer, number, one_of

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
    check_device(cfg.device)


def _load(cfg: DictConfig, device: Any) -> tuple[Any, dict[str, Any], Any]:
    """The diffusion system of ``ckpt_path``, built from the run spec its stored config gives for ``device`` (which
    decides ``model.use_flash_attention=auto``), with its (EMA) weights; the stored config; and the precision to
    sample in: ``precision`` if given, else the trained ``trainer.precision`` decided for this device (by
    :func:`voxdiff.step.decide_precision`, as the Trainer decided it).

    Raises:
        ConfigError: the checkpoint is refused, or the precision cannot run on this device (naming ``precision``).
    """
    import torch

    # deferred: Lightning costs seconds at start-up; a refused config exits before it is imported
    from voxdiff.lightning.systems import rebuild_system

    device_type = torch.device(device).type
    system, checkpoint, spec = rebuild_system(str(cfg.ckpt_path), "diffusion", _CKPT_FIX, device_type=device_type,
                                              precision=cfg.get("precision"))
    if spec is None:  # no run config stored: no trained precision, no validation masks
        raise _no_run_config(cfg)
    return system.to(device), checkpoint[CONFIG_KEY], spec.precision


def _no_run_config(cfg: DictConfig) -> ConfigError:
    return ConfigError("ckpt_path", cfg.ckpt_path, "the checkpoint carries no data config (voxdiff_config)",
                       "use a checkpoint written by python train.py")


def _datamodule(saved: dict[str, Any], cfg: DictConfig):
    import lightning as L

    data = dict(saved.get("data") or {})
    if not data:
        raise _no_run_config(cfg)
    for key, value in (plain(cfg.get("data")) or {}).items():
        if value is not None:
            data[key] = value
    try:
        cls, kwargs = voxdiff_class(data, "data", L.LightningDataModule, ("voxdiff.data",), _CKPT_FIX)
    except ConfigError as err:
        raise ConfigError("ckpt_path", cfg.ckpt_path, f"its stored data config is refused ({err})",
                          _CKPT_FIX) from None
    return cls(**kwargs)


def sample(cfg: DictConfig) -> list[Path]:
    """Load, generate and write; returns the montage paths."""
    import torch
    from torch.utils.data import ConcatDataset, DataLoader, Subset

    # deferred: Lightning costs seconds at start-up; a refused config exits before it is imported
    from voxdiff.lightning.samples import save_samples
    from voxdiff.lightning.trainer import configure_cpu_threads

    configure_cpu_threads()
    device = pick_device(cfg.device)
    system, saved, precision = _load(cfg, device)
    sampler = system.sampler(cfg.get("num_inference_steps"), cfg.get("eta"), cfg.get("guidance_scale"))
    dm = _datamodule(saved, cfg)
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
        with precision.autocast():
            generated = system.generate(batch["mask"], num_inference_steps=sampler.num_inference_steps,
                                        generator=generator, use_ema=bool(cfg.use_ema), eta=sampler.eta,
                                        guidance_scale=sampler.guidance_scale, batch_size=int(cfg.batch_size))
        pngs += save_samples(out_dir, "sample", system.mode, generated.cpu(), batch["mask"], batch.get("image"),
                             batch["affine"], batch["subject"])
        print(f"[voxdiff] {len(pngs)}/{n}: {pngs[-1]}", flush=True)
    return pngs


@hydra.main(config_path=str(config_dir()), config_name="sample", version_base="1.3")
def main(cfg: DictConfig) -> None:
    """The ``voxdiff-sample`` / ``python sample.py`` entry point."""
    with refusals():
        validate(cfg)
        sample(cfg)


if __name__ == "__main__":
    main()
