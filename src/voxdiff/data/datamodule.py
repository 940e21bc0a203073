"""The Lightning data module: the demo phantom or a NIfTI folder, split by subject into train and validation.

Batches are default-collated contract samples: ``{"image": (B, 1, D, H, W) float32 in [0, 1], "mask":
(B, 1, D, H, W) float32 in {0, 1}, "subject": list[str] (B), "affine": (B, 4, 4) float64}``, and with
``data.covariates`` also ``"covariates": (B, K)`` float32 (:mod:`voxdiff.data.covariates`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
from torch.utils.data import DataLoader, Dataset, Subset

from voxdiff.data.covariates import (
    TABLE_NAME,
    CovariateEncoding,
    WithCovariates,
    parse_covariates,
    phantom_table,
    read_table,
    subject_covariates,
)
from voxdiff.data.nifti import IMAGE_NAME, MASK_NAME, DataError, NiftiDataset, _stamp, check_cache, find_subjects
from voxdiff.data.phantom import PHANTOM_COVARIATES, PhantomDataset, check_volume_shape, subject_name
from voxdiff.data.shared import launch_rank, one_writes
from voxdiff.data.split import check_drop_last, check_num_subjects, split_settings, split_subjects
from voxdiff.errors import ConfigError, integer, plain
from voxdiff.files import atomic_write

log = logging.getLogger(__name__)


class VolumeDataModule(L.LightningDataModule):
    """Train/validation data for the diffusion system: the built-in phantom (``root=None``) or a NIfTI folder.

    Discovery, validation of every file header and the subject split happen in the constructor, so a bad
    config or a broken file is refused before anything trains. Loading (and caching) happens in :meth:`setup`.

    Args:
        volume_shape: ``(D, H, W)``, THE size of every volume, phantom and real alike (``data.volume_shape``).
        root: folder of subject folders (see :mod:`voxdiff.data.nifti`); ``None`` = the demo phantom.
        image_name: image file name inside each subject folder.
        mask_name: mask file name inside each subject folder.
        num_subjects: number of phantom subjects (demo only; seeds ``0 .. num_subjects - 1``).
        val_fraction: fraction of subjects held out for validation (at least 1, leaving at least 1 to train).
        split_seed: seed of the subject split.
        batch_size: volumes per batch.
        num_workers: DataLoader worker processes (kept alive between epochs when > 0).
        cache: ``"none"``, ``"memory"`` or ``"disk"`` (NIfTI: see :class:`NiftiDataset`; phantom: anything but
            ``"none"`` generates every subject once at setup and keeps it in memory).
        cache_dir: folder for ``cache="disk"`` (NIfTI only).
        pin_memory: DataLoader ``pin_memory`` (faster host→GPU copies).
        covariates: the participants table's columns to condition on (``data.covariates``; None or ``[]``: none).
            The phantom's are those of :data:`~voxdiff.data.phantom.PHANTOM_COVARIATES`, and shape its anatomy.
        covariates_table: the table (default ``<root>/participants.tsv``; the phantom makes its own).
        shuffle_covariates: a negative control: each subject trains with another subject's covariate vector (a
            random permutation without fixed points, seeded by ``split_seed``), so nothing ties them to the
            anatomy; the stored encoding, and the values sampling asks for, are unchanged.
        drop_last: leave out each epoch's last, smaller training batch (:func:`~voxdiff.data.split.check_drop_last`:
            one batch shape for a compiled step; the configs' default on a GPU).

    Attributes:
        covariate_encoding: the :class:`~voxdiff.data.covariates.CovariateEncoding` fitted on the training split
            (None without covariates); the run stores it in its checkpoints.

    Raises:
        ConfigError: an argument that cannot work (named as ``data.<key>``).
        DataError: the data folder or a file in it cannot be used, or it holds fewer than 2 subjects.
    """

    #: the arguments that name a folder or a file, read or written: a command that rebuilds this module from a
    #: checkpoint's stored config takes them from its own command line, never from the file
    #: (:mod:`voxdiff.cli.checkpoint_paths`)
    path_args: tuple[str, ...] = ("root", "cache_dir", "covariates_table")

    def __init__(
        self,
        volume_shape: Sequence[int],
        root: str | os.PathLike[str] | None = None,
        image_name: str = IMAGE_NAME,
        mask_name: str = MASK_NAME,
        num_subjects: int = 8,
        val_fraction: float = 0.25,
        split_seed: int = 0,
        batch_size: int = 1,
        num_workers: int = 0,
        cache: str = "memory",
        cache_dir: str | os.PathLike[str] | None = None,
        pin_memory: bool = False,
        covariates: Sequence[str] | None = None,
        covariates_table: str | os.PathLike[str] | None = None,
        shuffle_covariates: bool = False,
        drop_last: bool = False,
    ) -> None:
        super().__init__()
        self.volume_shape = check_volume_shape(plain(volume_shape), key="data.volume_shape")
        root = plain(root)
        self.root: str | None = None if root is None else str(Path(str(root)).expanduser())
        self.image_name = self._name("data.image_name", plain(image_name))
        self.mask_name = self._name("data.mask_name", plain(mask_name))
        self.num_subjects = check_num_subjects(num_subjects)
        self.val_fraction, self.split_seed = split_settings(val_fraction, split_seed)
        self.batch_size = integer("data.batch_size", batch_size, minimum=1, fix="set data.batch_size to 1 or more")
        self.num_workers = integer("data.num_workers", num_workers, minimum=0,
                                   fix="set data.num_workers to 0 (main process) or more")
        self.cache = check_cache(cache)
        cache_dir = plain(cache_dir)
        self.cache_dir: str | None = None if cache_dir is None else str(Path(str(cache_dir)).expanduser())
        if self.cache == "disk" and self.root is not None and self.cache_dir is None:
            raise ConfigError(
                "data.cache_dir", None, "data.cache=disk needs a folder to write the cache to",
                "set data.cache_dir to a writable folder, or use data.cache=memory",
            )
        self.pin_memory = bool(pin_memory)

        # discover, validate and split now: errors come before training, not an hour in
        self._records: list[dict[str, str]] | None = None
        if self.root is None:
            if self.num_subjects < 2:
                raise ConfigError(
                    "data.num_subjects", self.num_subjects,
                    "the demo phantom needs at least 2 subjects (1 train + 1 validation)", "set data.num_subjects=8",
                )
            names = [subject_name(i) for i in range(self.num_subjects)]
        else:
            self._records = find_subjects(self.root, self.image_name, self.mask_name, validate=True)
            if len(self._records) < 2:
                raise DataError(
                    f"data root {self.root} holds {len(self._records)} subject folder(s); at least 2 are needed "
                    "(1 train + 1 validation)"
                )
            names = [r["subject"] for r in self._records]
        self._train_idx, self._val_idx = split_subjects(names, self.val_fraction, self.split_seed)
        self.train_subjects: list[str] = [names[i] for i in self._train_idx]
        self.val_subjects: list[str] = [names[i] for i in self._val_idx]
        self.drop_last = check_drop_last(plain(drop_last), self.batch_size, len(self.train_subjects))
        self.train_dataset: Dataset | None = None
        self.val_dataset: Dataset | None = None
        self.covariate_encoding: CovariateEncoding | None = None
        self._covariate_vectors: dict[str, Any] = {}
        self.covariate_values: dict[str, dict[str, str]] = {}  # subject -> the table's values of the columns
        self.covariate_trained_values: dict[str, dict[str, str]] = {}  # subject -> the values its vector encodes
        self._fit_covariates(parse_covariates(covariates), plain(covariates_table), names, bool(shuffle_covariates))

    def _fit_covariates(self, columns: list[tuple[str, str | None]], table_path: Any, names: list[str],
                        shuffle: bool) -> None:
        """Read the participants table (the phantom's own, or ``covariates_table``, or ``<root>/participants.tsv``)
        and fit the encoding on the training split; every subject is checked now (before anything trains)."""
        self.covariates_table: str | None = None if table_path is None else str(Path(str(table_path)).expanduser())
        if not columns:
            return
        if self.root is None:
            unknown = [n for n, _ in columns if n not in PHANTOM_COVARIATES]
            if unknown:
                raise ConfigError("data.covariates", [n for n, _ in columns], f"the phantom has no covariate "
                                  f"{unknown[0]!r}", f"use some of {list(PHANTOM_COVARIATES)}")
            table, source = phantom_table(names, list(range(len(names)))), "the phantom's participants table"
        else:
            source = self.covariates_table or str(Path(self.root) / TABLE_NAME)
            table = read_table(source)
        fitted = subject_covariates(columns, table, source, self.train_subjects, self.val_subjects)
        fitted = fitted.shuffled(self.split_seed) if shuffle else fitted
        self.covariate_encoding, self._covariate_vectors, self.covariate_values = (
            fitted.encoding, fitted.vectors, fitted.values)
        self.covariate_trained_values = fitted.trained_values

    @staticmethod
    def _name(key: str, value: Any) -> str:
        if not isinstance(value, str) or not value.strip():
            raise ConfigError(key, value, "must be a non-empty file name", f"e.g. {key}=bravo.nii.gz")
        return value

    @property
    def is_demo(self) -> bool:
        """Whether this serves the procedural phantom (``root=None``)."""
        return self.root is None

    def setup(self, stage: str | None = None) -> None:
        """Build the train and validation datasets (loads and caches the data; idempotent)."""
        if self.train_dataset is not None:
            return
        if self._records is None:
            full = PhantomDataset(self.volume_shape, self.num_subjects, cache=self.cache != "none",
                                  covariates=self.covariate_encoding is not None)
            self.train_dataset = Subset(full, self._train_idx)
            self.val_dataset = Subset(full, self._val_idx)
        else:
            kwargs: dict[str, Any] = {"cache": self.cache, "cache_dir": self.cache_dir, "validate": False}
            self.train_dataset = NiftiDataset([self._records[i] for i in self._train_idx], self.volume_shape, **kwargs)
            self.val_dataset = NiftiDataset([self._records[i] for i in self._val_idx], self.volume_shape, **kwargs)
            if self.cache == "disk":  # the node's rank 0 fills the cache; the others wait, then read it
                self._fill_disk_cache()
            elif self.cache != "memory":  # memory: every subject was loaded (and checked) above
                self._load_every_subject()
        if self.covariate_encoding is not None:
            self.train_dataset = WithCovariates(self.train_dataset, self._covariate_vectors)
            self.val_dataset = WithCovariates(self.val_dataset, self._covariate_vectors)

    def _fill_disk_cache(self) -> None:
        """``data.cache=disk``: rank 0 of the node loads every subject (which writes the cache) and then a marker
        naming these subjects' files (path, size, time); the other ranks wait for the marker, then load them from
        the cache."""
        import json

        records = [r for ds in (self.train_dataset, self.val_dataset) for r in ds.records]
        files = sorted((r["subject"], *[(str(r[k]), _stamp(str(r[k]))) for k in ("image", "mask")]) for r in records)
        key = hashlib.sha1(json.dumps(files).encode()).hexdigest()[:12]
        marker = self.train_dataset.cache_dir / f"filled-{key}"

        def fill() -> None:
            self._load_every_subject()
            atomic_write(marker, lambda f: f.write(b"filled\n"))

        one_writes(fill, marker.is_file, f"the disk cache {self.train_dataset.cache_dir}")
        if launch_rank("node") != 0:
            self._load_every_subject()  # from the cache now (each rank checks what it will train on)

    def _load_every_subject(self) -> None:
        """Load each subject once now (``cache=none|disk``), so that a NaN voxel or a blank image stops the run
        before training instead of at its first batch; with ``cache=disk`` this fills the cache."""
        from concurrent.futures import ThreadPoolExecutor

        t0 = time.perf_counter()
        jobs = [(ds, i) for ds in (self.train_dataset, self.val_dataset) for i in range(len(ds))]
        with ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1))) as pool:
            for _ in pool.map(lambda job: job[0][job[1]], jobs):
                pass
        log.info("checked the intensities of %d subjects in %.1f s", len(jobs), time.perf_counter() - t0)

    def _loader(self, dataset: Dataset, shuffle: bool) -> DataLoader:
        """The training loader (``shuffle``) drops the last, smaller batch with ``drop_last``; validation never."""
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=shuffle,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            persistent_workers=self.num_workers > 0,
            drop_last=self.drop_last and shuffle,
        )

    def train_dataloader(self) -> DataLoader:
        """Shuffled batches of the training subjects."""
        self.setup("fit")
        assert self.train_dataset is not None
        world = self.trainer.world_size if self.trainer is not None else 1  # each process gets its share
        check_drop_last(self.drop_last, self.batch_size, len(self.train_subjects), world)
        return self._loader(self.train_dataset, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        """Batches of the validation subjects, in a fixed order."""
        self.setup("validate")
        assert self.val_dataset is not None
        return self._loader(self.val_dataset, shuffle=False)
