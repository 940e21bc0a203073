"""The latent cache of latent diffusion: volumes encoded once by a learned encoding (a trained stage 1), then
trained on.

``python cache_latents.py stage1_ckpt=CKPT out=DIR`` (:mod:`voxdiff.cli.cache_latents`) calls
:func:`write_latent_cache`; a latent experiment (``data: latents``, a learned ``encoding``) trains on the cache
through :class:`LatentDataModule` (``configs/data/latents.yaml``), which refuses a cache that other weights or
another volume shape made. Both use only the :class:`~voxdiff.encodings.LearnedEncoding` protocol.

Layout of a cache folder::

    DIR/index.json                 what made the cache and what it holds (written last: no index, no cache)
    DIR/latents/<subject>.pt       {"image_z": (C, d, h, w) float32, "mask_z": (C, d, h, w) float32,
                                    "mask_bits": (ceil(D·H·W / 8),) uint8, "affine": (4, 4) float64}

``image_z``/``mask_z`` are exactly the encoding's ``encode`` of the volume (for the VQ-VAE: the *quantised* latents,
codebook vectors, never an unquantised or sampled z) times its ``latent_scale``, which is also what the
diffusion system's ``encode_batch`` would compute on the fly. ``mask_bits`` is the full-resolution mask, bit-packed
(``numpy.packbits`` in C order, 1/32 of float32): batches carry it, unpacked, as ``mask`` so that the diffusion
system can sample from validation masks during training and ``sample.py`` from any split (``data.masks=false``
leaves it out). Images are not stored: montages of latent runs show mask | generated.

``index.json`` holds: ``format``; ``volume_shape`` (D, H, W); ``latent_shape`` (C, d, h, w) per modality;
``factor``; ``latent_channels`` (per modality); ``scale_factor`` (the ``latent_scale`` the latents carry);
``encoding`` (the class that made it; absent in caches written before it was recorded: those are
:class:`~voxdiff.encodings.VQVAELatent`'s); ``stage1`` (:meth:`~voxdiff.encodings.LearnedEncoding.weights_record`:
checkpoint path, ``sha256`` of its weights — the identity that is checked —, for the VQ-VAE also the architecture
and training volume shape); ``data`` (where the volumes came from); ``stats`` (mean/std of the cached latents);
``subjects`` (name → file, in dataset order); ``created``.

A cache reads only the files inside its folder. Each ``subjects`` entry is a name relative to the cache folder
(``latents/<subject>.pt``: the writer makes every subject name a plain file name); an entry that is absolute, that
climbs out through ``..``, or that resolves outside the folder through a symbolic link is refused
(:func:`cache_member`), naming the index file and the entry — when the cache is checked and again when the file is
read. The index's ``stage1.checkpoint`` and ``data`` are a record of where the cache came from, shown in messages and
never read.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from collections.abc import Mapping, Sequence
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from voxdiff.config import voxdiff_class
from voxdiff.data.covariates import TABLE_NAME, WithCovariates, parse_covariates, read_table, subject_covariates
from voxdiff.data.split import check_drop_last, split_settings, split_subjects
from voxdiff.data.phantom import check_volume_shape
from voxdiff.encodings.base import LearnedEncoding
from voxdiff.errors import ConfigError, integer, plain
from voxdiff.files import atomic_write, load_file

INDEX_NAME = "index.json"
FORMAT = "voxdiff-latents/1"
LATENT_KEYS = ("image_z", "mask_z")
#: what every index holds (read_index refuses an index without them)
INDEX_KEYS = ("format", "volume_shape", "latent_shape", "factor", "latent_channels", "stage1", "subjects")
#: the encoding of an index that does not name one (written before the index recorded it)
DEFAULT_ENCODING = "voxdiff.encodings.VQVAELatent"


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", str(name)).strip("_") or "subject"


def _atomic_write(path: Path, write) -> None:  # noqa: ANN001 - write(file object)
    """Write ``path`` so that readers never see half a file (the checkpoints' atomic writer)."""
    atomic_write(path, write)


def pack_mask(mask: torch.Tensor) -> torch.Tensor:
    """``(..., D, H, W)`` mask in {0, 1} → bit-packed ``uint8`` (``numpy.packbits`` of ``mask > 0.5``, C order)."""
    bits = (mask.detach().cpu() > 0.5).numpy().reshape(-1)
    return torch.from_numpy(np.packbits(bits))


def unpack_mask(bits: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """Inverse of :func:`pack_mask`: ``(1, D, H, W)`` float32 in {0, 1}."""
    n = int(np.prod(shape))
    flat = np.unpackbits(bits.numpy(), count=n)
    return torch.from_numpy(flat.astype(np.float32)).reshape(1, *shape)


def cache_member(cache_dir: str | Path, subject: str, entry: Any, key: str = "data.latent_dir") -> Path:
    """The file an index entry names, only when it lies inside the cache folder.

    Args:
        cache_dir: the cache folder.
        subject: the entry's subject (for the message).
        entry: the index's ``subjects[subject]``: a name relative to ``cache_dir`` (``latents/<subject>.pt``).
        key: the config key that named the cache.

    Raises:
        ConfigError: the entry is not a relative name, climbs out with ``..``, or resolves (through a symbolic link)
            outside ``cache_dir``; naming the index file, the subject, the entry and the fix.
    """
    cache_dir = Path(cache_dir)
    index_path = cache_dir / INDEX_NAME
    why = None
    if not isinstance(entry, str) or not entry.strip():
        why = "is not a file name"
    elif PurePosixPath(entry).is_absolute() or PureWindowsPath(entry).is_absolute() or PureWindowsPath(entry).drive:
        why = "is an absolute path"
    elif ".." in PurePosixPath(entry.replace("\\", "/")).parts:
        why = "climbs out of the cache folder through '..'"
    else:
        inside = cache_dir.resolve()
        target = (cache_dir / entry).resolve()
        if not target.is_relative_to(inside):
            why = f"resolves to {target}, outside the cache folder (a symbolic link)"
    if why is not None:
        raise ConfigError(key, str(cache_dir), f"{index_path}: the entry of subject {subject!r}, {entry!r}, {why}; a "
                          "latent cache reads only the files inside its folder, named relative to it",
                          "rewrite the cache with python cache_latents.py (it names every file latents/<subject>.pt)")
    return cache_dir / entry


def cache_command(stage1_ckpt: str, out: str | Path, volume_shape: Sequence[int]) -> str:
    """The command line that (re)makes a cache: quoted in every refusal's fix."""
    shape = ",".join(str(int(s)) for s in volume_shape)
    return f"python cache_latents.py stage1_ckpt={stage1_ckpt} out={out} data.volume_shape=[{shape}]"


@torch.no_grad()
def write_latent_cache(
    encoding: LearnedEncoding,
    dataset: Dataset,
    out_dir: str | Path,
    volume_shape: Sequence[int],
    data_info: Mapping[str, Any] | None = None,
    device: str | torch.device = "cpu",
    batch_size: int = 1,
    num_workers: int = 0,
    log: Any = None,
) -> dict[str, Any]:
    """Encode every sample of ``dataset`` with a learned encoding (its weights named) into ``out_dir``.

    Any previous index in ``out_dir`` is removed first and the new one written last, so an interrupted run
    leaves no usable (half) cache behind.

    Args:
        encoding: a :class:`~voxdiff.encodings.LearnedEncoding` whose weights file is named (read if needed).
        dataset: samples of the data contract (``image``, ``mask`` ``(1, D, H, W)``, ``subject``, ``affine``).
        out_dir: the cache folder (created).
        volume_shape: ``(D, H, W)`` of the samples (checked on every sample).
        data_info: where the volumes came from (recorded in the index).
        device: where to encode.
        batch_size: volumes encoded together.
        num_workers: DataLoader workers reading the volumes.
        log: a callable taking one message per encoded batch (progress), or None.

    Returns:
        The index (also written to ``out_dir/index.json``).
    """
    if not isinstance(encoding, LearnedEncoding):
        raise TypeError(f"write_latent_cache needs a LearnedEncoding (weights, an identity, a latent scale), got "
                        f"{type(encoding).__name__}, which is weight-free: train on its volumes directly")
    volume_shape = tuple(int(s) for s in volume_shape)
    latent_shape = list(encoding.encoded_shape((1, *volume_shape)))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / INDEX_NAME).unlink(missing_ok=True)
    device = torch.device(device)
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False, num_workers=num_workers)
    subjects: dict[str, str] = {}
    sums = {k: torch.zeros(3, dtype=torch.float64) for k in LATENT_KEYS}  # n, Σz, Σz²
    t0 = time.perf_counter()
    for batch in loader:
        for key in ("image", "mask"):
            if tuple(batch[key].shape[2:]) != volume_shape:
                raise ValueError(f"batch[{key!r}] has spatial shape {tuple(batch[key].shape[2:])}, the cache is "
                                 f"for {volume_shape}")
        z = {f"{k}_z": encoding.encode(batch[k].to(device)).float().cpu() for k in ("image", "mask")}
        for i, subject in enumerate(batch["subject"]):
            rel = f"latents/{_safe(subject)}.pt"
            if subject in subjects or rel in subjects.values():
                raise ValueError(f"subject {subject!r} appears twice (or collides with another name as {rel})")
            record = {
                "image_z": z["image_z"][i].clone(),
                "mask_z": z["mask_z"][i].clone(),
                "mask_bits": pack_mask(batch["mask"][i]),
                "affine": torch.as_tensor(batch["affine"][i], dtype=torch.float64).clone(),
            }
            _atomic_write(out / rel, lambda f, r=record: torch.save(r, f))
            subjects[str(subject)] = rel
        for k in LATENT_KEYS:
            v = z[k].double()
            sums[k] += torch.stack([v.new_tensor(v.numel()), v.sum(), (v**2).sum()])
        if log is not None:
            log(f"encoded {len(subjects)}/{len(dataset)} subjects ({time.perf_counter() - t0:.1f} s)")
    if not subjects:
        raise ValueError("the dataset is empty: nothing to cache")
    stats = {}
    for k, (n, s1, s2) in sums.items():
        mean = float(s1 / n)
        stats[k] = {"mean": mean, "std": math.sqrt(max(float(s2 / n) - mean**2, 0.0))}
    index = {
        "format": FORMAT,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "volume_shape": list(volume_shape),
        "latent_shape": latent_shape,
        "factor": encoding.factor,
        "latent_channels": encoding.encoded_channels(1),
        "scale_factor": encoding.latent_scale,
        "encoding": f"{type(encoding).__module__}.{type(encoding).__qualname__}",
        "stage1": encoding.weights_record(),
        "data": dict(data_info or {}),
        "stored": {
            "image_z": f"{type(encoding).__name__}.encode(image): scale_factor x latents, float32 (C, d, h, w)",
            "mask_z": f"{type(encoding).__name__}.encode(mask): scale_factor x latents, float32 (C, d, h, w)",
            "mask_bits": "the full-resolution mask, numpy.packbits(mask > 0.5) in C order",
            "affine": "(4, 4) float64 voxel-to-world matrix of the volume",
        },
        "stats": stats,
        "subjects": subjects,
        "seconds": round(time.perf_counter() - t0, 2),
    }
    _atomic_write(out / INDEX_NAME, lambda f: f.write(json.dumps(index, indent=2).encode()))
    return index


def read_index(cache_dir: str | Path, key: str = "data.latent_dir") -> dict[str, Any]:
    """The index of a latent cache, or a :class:`ConfigError` that says how to make one."""
    cache_dir = Path(cache_dir)
    path = cache_dir / INDEX_NAME
    if not path.is_file():
        raise ConfigError(key, str(cache_dir), f"no latent cache there (no {INDEX_NAME}; an interrupted cache run "
                          "leaves none)", "make it: python cache_latents.py stage1_ckpt=<stage-1 checkpoint> "
                          f"out={cache_dir} data.volume_shape=[D,H,W]")
    remake = ("rewrite the cache: python cache_latents.py stage1_ckpt=<stage-1 checkpoint> "
              f"out={cache_dir} data.volume_shape=[D,H,W]")
    try:
        index = json.loads(path.read_text())
    except UnicodeDecodeError:
        raise ConfigError(key, str(cache_dir), f"{path} is not valid JSON (not UTF-8 text): the index is damaged",
                          remake) from None
    except json.JSONDecodeError as err:
        raise ConfigError(key, str(cache_dir), f"{path} is not valid JSON ({err.msg} at line {err.lineno}, column "
                          f"{err.colno}): the index is damaged", remake) from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        found = index.get("format") if isinstance(index, dict) else type(index).__name__
        raise ConfigError(key, str(cache_dir), f"{path} has format {found!r}, this voxdiff reads {FORMAT!r}", remake)
    missing = [k for k in INDEX_KEYS if k not in index] + [
        f"stage1.{k}" for k in ("checkpoint", "sha256") if k not in (index.get("stage1") or {})]
    if missing or not isinstance(index.get("subjects"), dict):
        raise ConfigError(key, str(cache_dir), f"{path} lacks {', '.join(missing) or 'its subjects'}: the index is "
                          "damaged", remake)
    for subject, entry in index["subjects"].items():
        cache_member(cache_dir, subject, entry, key)
    return index


def check_latent_cache(
    cache_dir: str | Path,
    volume_shape: Sequence[int],
    stage1_checkpoint: str | None,
    factor: int,
    latent_channels: int,
    key: str = "data.latent_dir",
) -> dict[str, Any]:
    """Refuse a cache that does not belong to this config; return its index.

    A cache belongs to a config when it was made from volumes of ``volume_shape`` by the weights in
    ``stage1_checkpoint`` (compared by the encoding's :attr:`~voxdiff.encodings.LearnedEncoding.weights_identity`,
    the SHA-256 of the weights, so a moved or copied checkpoint still matches and a retrained one does not), with
    this encoding's factor and latent channels, and all its files exist.

    Raises:
        ConfigError: naming the cache, what differs, and the fix (re-run the cache command).
    """
    cache_dir = Path(cache_dir)
    index = read_index(cache_dir, key)
    volume_shape = [int(s) for s in volume_shape]
    made_by = index["stage1"]["checkpoint"]
    if stage1_checkpoint is None:
        raise ConfigError("encoding.checkpoint", None,
                          f"latent diffusion decodes its samples with the stage-1 weights, and the latent cache "
                          f"{cache_dir} was made by {made_by}", f"set encoding.checkpoint={made_by}")
    redo = cache_command(str(stage1_checkpoint), cache_dir, volume_shape)
    if index["volume_shape"] != volume_shape:
        raise ConfigError(
            key, str(cache_dir),
            f"the latent cache was made from volumes of {index['volume_shape']}, but data.volume_shape is "
            f"{volume_shape}",
            f"re-run the cache command for this shape ({redo}), or set data.volume_shape={index['volume_shape']}",
        )
    for name, mine in (("factor", factor), ("latent_channels", latent_channels)):
        if index[name] != mine:
            raise ConfigError(key, str(cache_dir),
                              f"the latent cache has {name} {index[name]}, but encoding.{name} is {mine}",
                              f"re-run the cache command with a matching stage-1 checkpoint ({redo})")
    identity = index_encoding(index, key, cache_dir).from_weights(str(stage1_checkpoint)).weights_identity
    if identity != index["stage1"]["sha256"]:
        raise ConfigError(
            key, str(cache_dir),
            f"the latent cache was made by another stage-1 checkpoint: {made_by} (weights sha256 "
            f"{index['stage1']['sha256'][:12]}…), but encoding.checkpoint={stage1_checkpoint} has weights "
            f"{identity[:12]}…; its latents would be decoded by a decoder that did not make them",
            f"re-run the cache command with this checkpoint ({redo}), or set encoding.checkpoint={made_by}",
        )
    missing = [s for s, rel in index["subjects"].items() if not cache_member(cache_dir, s, rel, key).is_file()]
    if missing:
        raise ConfigError(key, str(cache_dir), f"{len(missing)} latent file(s) of the index are missing "
                          f"(e.g. {missing[0]})", f"re-run the cache command ({redo})")
    return index


def index_encoding(index: Mapping[str, Any], key: str, cache_dir: str | Path) -> type[LearnedEncoding]:
    """The :class:`~voxdiff.encodings.LearnedEncoding` class that made a cache (its index's ``encoding``; only
    voxdiff's own encoding classes are imported)."""
    target = index.get("encoding", DEFAULT_ENCODING)
    cls, _ = voxdiff_class({"_target_": target}, f"{key} ({cache_dir}/{INDEX_NAME}: encoding)", LearnedEncoding,
                           ("voxdiff.encodings",), "rewrite the cache with python cache_latents.py")
    return cls


class LatentDataset(Dataset):
    """Samples of a latent cache: ``{"image_z": (C, d, h, w), "mask_z": (C, d, h, w), "subject": str,
    "affine": (4, 4) float64}`` float32 latents, plus ``"mask": (1, D, H, W)`` float32 in {0, 1} when
    ``with_mask``.

    Args:
        cache_dir: the cache folder.
        index: its index (:func:`check_latent_cache`).
        subjects: the subjects served, in order.
        with_mask: also unpack the full-resolution mask (the diffusion system and ``sample.py`` sample from it).
        in_memory: keep every loaded file in memory (latents are small: 4·d·h·w floats per modality).
    """

    def __init__(self, cache_dir: str | Path, index: Mapping[str, Any], subjects: Sequence[str],
                 with_mask: bool = False, in_memory: bool = True) -> None:
        self.cache_dir = Path(cache_dir)
        self.index = dict(index)
        self.subjects = list(subjects)
        self.with_mask = with_mask
        self.in_memory = in_memory
        self._memory: dict[int, dict[str, torch.Tensor]] = {}

    def __len__(self) -> int:
        return len(self.subjects)

    def _load(self, i: int) -> dict[str, torch.Tensor]:
        if i in self._memory:
            return self._memory[i]

        subject = self.subjects[i]
        path = cache_member(self.cache_dir, subject, self.index["subjects"][subject])  # checked again: a link may be new
        record = load_file(path, "data.latent_dir", "rewrite the cache with python cache_latents.py (the command "
                           f"that made {self.cache_dir})")
        needed = (*LATENT_KEYS, "affine", *(("mask_bits",) if self.with_mask else ()))
        missing = [k for k in needed if not isinstance(record, dict) or k not in record]
        if missing:
            raise ConfigError("data.latent_dir", str(self.cache_dir), f"{path} lacks {', '.join(missing)}",
                              "rewrite the cache with python cache_latents.py")
        if self.in_memory:
            self._memory[i] = record
        return record

    def __getitem__(self, i: int) -> dict[str, Any]:
        record = self._load(i)
        sample: dict[str, Any] = {
            "image_z": record["image_z"],
            "mask_z": record["mask_z"],
            "subject": self.subjects[i],
            "affine": record["affine"],
        }
        if self.with_mask:
            sample["mask"] = unpack_mask(record["mask_bits"], self.index["volume_shape"])
        return sample


class LatentDataModule(L.LightningDataModule):
    """Train/validation batches of a latent cache, split by subject as :class:`voxdiff.data.VolumeDataModule`
    splits volumes (same names, ``val_fraction`` and ``split_seed`` → the same validation subjects).

    The cache is checked in the constructor (:func:`check_latent_cache`), so a stale cache is refused before any
    model is built. Batches: ``image_z``/``mask_z`` ``(B, C, d, h, w)``, ``subject``, ``affine``; validation
    and ``mask`` ``(B, 1, D, H, W)`` float32 in {0, 1} (``masks``).

    Args:
        latent_dir: the cache folder (``python cache_latents.py ... out=DIR``).
        volume_shape: ``(D, H, W)`` of the volumes this run is about (``data.volume_shape``).
        stage1_checkpoint: the stage-1 checkpoint the run decodes with (``encoding.checkpoint``).
        factor: ``encoding.factor``.
        latent_channels: ``encoding.latent_channels``.
        val_fraction: fraction of subjects for validation.
        split_seed: seed of the subject split.
        batch_size: samples per batch.
        num_workers: DataLoader workers.
        in_memory: keep loaded latents in memory.
        masks: batches carry the full-resolution ``mask`` (samples during training and from ``sample.py`` need
            it; the diffusion loss uses ``mask_z``).
        pin_memory: DataLoader ``pin_memory``.
        covariates, covariates_table: as :class:`voxdiff.data.VolumeDataModule`'s (the table in the cache).
        drop_last: leave out each epoch's last, smaller training batch (:func:`voxdiff.data.split.check_drop_last`).
    """

    #: the arguments that name a folder or a file (read): a command that rebuilds this module from a checkpoint's
    #: stored config takes them from its own command line, never from the file (:mod:`voxdiff.cli.checkpoint_paths`)
    path_args: tuple[str, ...] = ("latent_dir", "stage1_checkpoint", "covariates_table")

    def __init__(
        self,
        latent_dir: str | os.PathLike[str] | None,
        volume_shape: Sequence[int],
        stage1_checkpoint: str | os.PathLike[str] | None,
        factor: int,
        latent_channels: int,
        val_fraction: float = 0.25,
        split_seed: int = 0,
        batch_size: int = 1,
        num_workers: int = 0,
        in_memory: bool = True,
        masks: bool = True,
        pin_memory: bool = False,
        covariates: Sequence[str] | None = None,
        covariates_table: str | os.PathLike[str] | None = None,
        drop_last: bool = False,
    ) -> None:
        super().__init__()

        latent_dir = plain(latent_dir)
        if latent_dir is None:
            raise ConfigError("data.latent_dir", None, "latent diffusion trains on a latent cache",
                              "make one (python cache_latents.py stage1_ckpt=<stage-1 checkpoint> out=DIR "
                              "data.volume_shape=[D,H,W]) and set data.latent_dir=DIR")
        self.latent_dir = Path(str(latent_dir)).expanduser()
        self.volume_shape = check_volume_shape(plain(volume_shape), key="data.volume_shape")
        val_fraction, split_seed = split_settings(val_fraction, split_seed)
        for key, value, low in (("batch_size", batch_size, 1), ("num_workers", num_workers, 0)):
            integer(f"data.{key}", value, minimum=low, example=low)
        self.index = check_latent_cache(self.latent_dir, self.volume_shape, plain(stage1_checkpoint), factor,
                                        latent_channels)
        names = list(self.index["subjects"])
        if len(names) < 2:
            raise ConfigError("data.latent_dir", str(self.latent_dir),
                              f"the cache holds {len(names)} subject(s); at least 2 are needed (1 train + 1 val)",
                              "cache a dataset with more subjects")
        train_idx, val_idx = split_subjects(names, val_fraction, split_seed)
        self.train_subjects = [names[i] for i in train_idx]
        self.val_subjects = [names[i] for i in val_idx]
        self.batch_size = batch_size
        self.drop_last = check_drop_last(plain(drop_last), batch_size, len(self.train_subjects))
        self.num_workers = num_workers
        self.in_memory = bool(in_memory)
        self.masks = bool(masks)
        self.pin_memory = bool(pin_memory)
        self.train_dataset: LatentDataset | None = None
        self.val_dataset: LatentDataset | None = None
        # covariates travel with the cache: cache_latents.py copies the source's participants table into it
        self.covariate_encoding = self._covariates = None
        self.covariate_values: dict[str, dict[str, str]] = {}
        self.covariate_trained_values: dict[str, dict[str, str]] = {}  # its own: latents are never shuffled
        columns = parse_covariates(covariates)
        if columns:
            table = plain(covariates_table) or str(self.latent_dir / TABLE_NAME)
            self._covariates = subject_covariates(columns, read_table(table), str(table), self.train_subjects,
                                                  self.val_subjects)
            self.covariate_encoding, self.covariate_values = self._covariates.encoding, self._covariates.values
            self.covariate_trained_values = self._covariates.trained_values

    @property
    def latent_shape(self) -> tuple[int, ...]:
        """``(C, d, h, w)`` of one modality's latents."""
        return tuple(self.index["latent_shape"])

    def setup(self, stage: str | None = None) -> None:
        if self.train_dataset is None:
            self.train_dataset = LatentDataset(self.latent_dir, self.index, self.train_subjects, self.masks,
                                               self.in_memory)
            self.val_dataset = LatentDataset(self.latent_dir, self.index, self.val_subjects, self.masks,
                                             self.in_memory)
            # read every file once: a damaged one stops the run now, not at its first batch (in_memory keeps them)
            for dataset in (self.train_dataset, self.val_dataset):
                for i in range(len(dataset)):
                    dataset._load(i)
            if self._covariates is not None:
                self.train_dataset = WithCovariates(self.train_dataset, self._covariates.vectors)
                self.val_dataset = WithCovariates(self.val_dataset, self._covariates.vectors)

    def _loader(self, dataset: Dataset, shuffle: bool) -> DataLoader:
        return DataLoader(dataset, batch_size=self.batch_size, shuffle=shuffle, num_workers=self.num_workers,
                          pin_memory=self.pin_memory, persistent_workers=self.num_workers > 0,
                          drop_last=self.drop_last and shuffle)  # the training loader only

    def train_dataloader(self) -> DataLoader:
        self.setup("fit")
        world = self.trainer.world_size if self.trainer is not None else 1  # each process gets its share
        check_drop_last(self.drop_last, self.batch_size, len(self.train_subjects), world)
        return self._loader(self.train_dataset, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        self.setup("validate")
        return self._loader(self.val_dataset, shuffle=False)

