"""``python cache_latents.py stage1_ckpt=CKPT out=DIR [data.* ...]``: encode a dataset once into a latent cache.

compose → validate (the checkpoint holds weights of the learned encoding ``encoding._target_``, a
:class:`~voxdiff.encodings.LearnedEncoding`; the volume divides by its factor) → build the encoding and the data →
encode every subject (train and validation) → write ``DIR/latents/*.pt`` and, last, ``DIR/index.json``
(:func:`voxdiff.data.latents.write_latent_cache`) → print what to run next.

``data`` is the same config group as in ``train.py`` (``data.root``, ``data.num_subjects``, ...);
``data.volume_shape`` defaults to the shape stage 1 was trained on (where its checkpoint records it).

Exit codes (:mod:`voxdiff.cli.exit_codes`): 0 done; 2 the config or the stage-1 checkpoint was refused (nothing
was written); 5 the data was refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, open_dict

from voxdiff.cli.devices import pick_device
from voxdiff.cli.exit_codes import hydra_main, refusals
from voxdiff.config import compose, config_dir, instantiate_config, plain, require, run_kind, select, voxdiff_class
from voxdiff.encodings import Encoding, LearnedEncoding
from voxdiff.errors import ConfigError, Problems, int_list, integer
from voxdiff.files import atomic_write, check_output


@dataclass(frozen=True)
class CacheSpec:
    """What ``cache_latents.py`` runs, resolved once from its config (:func:`validate`); nothing after it reads
    the command's own keys.

    Attributes:
        encoding: the :class:`~voxdiff.encodings.LearnedEncoding` of ``stage1_ckpt``, its weights read.
        checkpoint: ``stage1_ckpt``.
        volume_shape: ``(D, H, W)``: ``data.volume_shape``, else the shape stage 1 was trained on.
        out: the cache folder.
        device: ``cuda`` or ``cpu`` (``device=auto`` resolved).
        batch_size: volumes encoded together.
        num_workers: the DataLoader's workers (``data.num_workers``).
    """

    encoding: Any
    checkpoint: str
    volume_shape: tuple[int, int, int]
    out: Path
    device: str
    batch_size: int
    num_workers: int


def validate(cfg: DictConfig) -> CacheSpec:
    """Check the command's config and load the stage-1 weights, every problem in one pass; nothing is written.

    Raises:
        ConfigError: the one problem, or :class:`~voxdiff.errors.ConfigErrors` naming every problem found.
    """
    require(cfg, "stage1_ckpt", "out", fix="python cache_latents.py stage1_ckpt=<stage-1 run>/checkpoints/last.ckpt "
            "out=DIR (train stage 1 first: python train.py experiment=vqvae_4x)")
    collect = Problems()
    ckpt = str(cfg.stage1_ckpt)
    cls = collect(lambda: voxdiff_class(cfg.encoding, "encoding", LearnedEncoding, ("voxdiff.encodings",),
                                        "name a learned encoding's class, e.g. "
                                        "encoding._target_=voxdiff.encodings.VQVAELatent")[0])
    encoding = collect(lambda: cls.from_weights(ckpt, key="stage1_ckpt")) if cls is not None else None
    shape = select(cfg, "data.volume_shape")
    if encoding is not None:
        if shape is None and encoding.trained_volume_shape is None:
            collect.found.append(ConfigError("data.volume_shape", None, f"the checkpoint {ckpt} does not record its "
                                             "volume shape", "set data.volume_shape=[D,H,W]"))
        elif shape is None:
            shape = list(encoding.trained_volume_shape)
        if shape is not None:
            shape = collect(lambda: int_list("data.volume_shape", shape, length=3, example=[160, 128, 128]))
        if shape is not None:
            collect(lambda: encoding.check_volume_shape(shape))
        collect(encoding.load_weights)
    out = Path(str(cfg.out))
    collect(lambda: check_output("out", str(cfg.out), folder=True, fix="choose a folder this user can write to"))
    batch = collect(lambda: integer("batch_size", cfg.batch_size, minimum=1, example=1))
    workers = collect(lambda: integer("data.num_workers", select(cfg, "data.num_workers", 0), minimum=0,
                                      fix="set data.num_workers to 0 (main process) or more"))
    device = collect(lambda: str(pick_device(select(cfg, "device"))))
    collect.raise_all()
    return CacheSpec(encoding=encoding, checkpoint=ckpt, volume_shape=tuple(shape),
                     out=out, device=device, batch_size=batch, num_workers=workers)


def cache(cfg: DictConfig) -> dict[str, Any]:
    """Validate, encode, write the cache; returns its index (``{}`` on the other ranks of a multi-process launch:
    rank 0 writes the one cache)."""
    from torch.utils.data import ConcatDataset

    # deferred: voxdiff.data.latents imports Lightning (seconds at start-up); a refused config exits before
    from voxdiff.data.latents import INDEX_NAME, write_latent_cache
    from voxdiff.data.shared import launch_rank

    spec = validate(cfg)
    encoding, shape, device = spec.encoding, spec.volume_shape, spec.device
    if launch_rank("world") != 0:  # launched on several processes (srun -n N): rank 0 writes the one cache; the
        print(f"[voxdiff] rank {launch_rank('world')}: rank 0 writes the latent cache {spec.out}",  # launcher's
              flush=True)  # step ends when rank 0 has written it
        return {}
    with open_dict(cfg):
        cfg.data.volume_shape = list(shape)
    datamodule = instantiate_config(cfg.data, _convert_="all")
    datamodule.setup("fit")
    dataset = ConcatDataset([datamodule.train_dataset, datamodule.val_dataset])
    info = {k: plain(cfg.data.get(k)) for k in ("root", "image_name", "mask_name", "num_subjects", "val_fraction",
                                                 "split_seed")}
    print(f"[voxdiff] encoding {len(dataset)} subjects of {list(shape)} with {spec.checkpoint} "
          f"(factor {encoding.factor}, {encoding.encoded_channels(1)} latent channels, latent scale "
          f"{encoding.latent_scale:.4g}) on {device}", flush=True)
    index = write_latent_cache(encoding, dataset, str(spec.out), shape, data_info=info, device=device,
                               batch_size=spec.batch_size, num_workers=spec.num_workers,
                               log=lambda m: print(f"[voxdiff] {m}", flush=True))
    out = spec.out.resolve()
    table = covariates_beside(datamodule, out)
    if table is not None:
        print(f"[voxdiff] covariates: {table} (train with data.covariates=[...]; they travel with the cache)",
              flush=True)
    print(f"[voxdiff] latent cache: {out / INDEX_NAME}: {len(index['subjects'])} subjects, latents "
          f"{index['latent_shape']} per modality, {index['seconds']} s", flush=True)
    experiments = "|".join(latent_experiments(type(encoding), encoding.factor)) or "<a latent experiment>"
    print(f"[voxdiff] next: python train.py experiment={experiments} "
          f"encoding.checkpoint={Path(spec.checkpoint).resolve()} data.latent_dir={out} "
          f"data.volume_shape=[{','.join(map(str, shape))}]", flush=True)
    return index


def covariates_beside(datamodule: Any, out: Path) -> Path | None:
    """The subjects' covariates into the cache folder (``participants.tsv``), so a latent run can condition on them:
    the source's table (``data.covariates_table``, else ``<data.root>/participants.tsv``) copied, or the phantom's
    (with ``data.covariates``, which also shape its anatomy). None: the source has none."""
    # deferred: voxdiff.data.covariates imports MONAI's transforms (seconds); a refused config exits before
    from voxdiff.data.covariates import TABLE_NAME, phantom_table, write_table

    target = out / TABLE_NAME
    source = getattr(datamodule, "covariates_table", None)
    root = getattr(datamodule, "root", None)
    if source is None and root is not None and (Path(root) / TABLE_NAME).is_file():
        source = str(Path(root) / TABLE_NAME)
    if source is not None:  # the table's own bytes, written atomically beside the cache's index
        return atomic_write(target, lambda f: f.write(Path(source).read_bytes()))
    if root is None and getattr(datamodule, "covariate_encoding", None) is not None:
        names = [*datamodule.train_subjects, *datamodule.val_subjects]
        seeds = [int(n.rsplit("-", 1)[1]) for n in names]
        return write_table(target, phantom_table(names, seeds))
    return None


def latent_experiments(encoding_class: type, factor: int) -> list[str]:
    """The diffusion experiments (``configs/experiment/*.yaml``) whose encoding is ``encoding_class`` with this
    ``factor``: those that train on this cache."""
    out = []
    for path in sorted((config_dir() / "experiment").glob("*.yaml")):
        cfg = compose("train", [f"experiment={path.stem}"])
        if run_kind(cfg) != "diffusion":
            continue
        cls, kwargs = voxdiff_class(cfg.encoding, "encoding", Encoding, ("voxdiff.encodings",), "")
        if cls is encoding_class and kwargs.get("factor") == factor:
            out.append(path.stem)
    return out


@hydra_main("cache_latents")
def main(cfg: DictConfig) -> None:
    """The ``python cache_latents.py`` entry point: a refusal prints one message and exits with its code."""
    with refusals():
        cache(cfg)


if __name__ == "__main__":
    main()
