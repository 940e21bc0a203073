"""Covariates: what is known about each subject (age, sex, lesion load, ...), from the dataset's participants table.

The table follows the neuroimaging convention, a BIDS ``participants.tsv``: tab-separated, a header line, one row per
subject, a ``participant_id`` column naming the subject folders under ``data.root`` (``data.covariates_table`` names
another file). ``data.covariates`` lists the columns to condition on, each ``name`` (its kind read from the values:
numeric when they are numbers) or ``name:numeric`` / ``name:categorical``.

The encoding (:class:`CovariateEncoding`) is decided on the training split only and stored in the checkpoint, so
sampling uses the same one:

* numeric: ``(value − mean) / std`` with the training subjects' mean and (population) standard deviation; the
  training range ``[min, max]`` is what a sampler may ask for;
* categorical: one-hot over the levels seen in training (sorted).

A subject's vector is ``(K,)`` float32: the columns in the listed order, then a last *presence* entry, 1. The null
covariates of classifier-free guidance are all zeros (presence 0), which no subject's vector equals.

Everything a table can get wrong is refused before launch as a :class:`~voxdiff.data.nifti.DataError` naming the
file, the subject and the column: a missing table or column, a subject missing from the table, an empty (``n/a``) or
non-numeric value in a numeric column, a level of a validation subject never seen in training, a column with one
value in training.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from voxdiff.data.nifti import DataError
from voxdiff.data.phantom import PHANTOM_COVARIATES, phantom_covariates
from voxdiff.data.split import split_subjects
from voxdiff.errors import ConfigError, plain
from voxdiff.files import atomic_write

ID_COLUMN = "participant_id"
TABLE_NAME = "participants.tsv"
KINDS = ("numeric", "categorical")
#: values BIDS uses for "not known"; an empty cell counts too
MISSING = ("", "n/a", "na", "nan")


@dataclass(frozen=True)
class Column:
    """One covariate: ``kind`` numeric (``mean``, ``std``, ``lo``, ``hi`` of the training split) or categorical
    (``levels``, sorted, as seen in training)."""

    name: str
    kind: str
    mean: float = 0.0
    std: float = 1.0
    lo: float = 0.0
    hi: float = 0.0
    levels: tuple[str, ...] = ()

    @property
    def width(self) -> int:
        return 1 if self.kind == "numeric" else len(self.levels)

    def to_plain(self) -> dict[str, Any]:
        if self.kind == "numeric":
            return {"name": self.name, "kind": self.kind, "mean": self.mean, "std": self.std, "min": self.lo,
                    "max": self.hi}
        return {"name": self.name, "kind": self.kind, "levels": list(self.levels)}


@dataclass(frozen=True)
class CovariateEncoding:
    """How the covariates of a run become the UNet's ``(K,)`` input (see the module docstring)."""

    columns: tuple[Column, ...]

    @property
    def names(self) -> list[str]:
        return [c.name for c in self.columns]

    @property
    def width(self) -> int:
        """``K``: every column's width plus the presence entry."""
        return sum(c.width for c in self.columns) + 1

    def to_plain(self) -> dict[str, Any]:
        """Plain data for a checkpoint's hyper-parameters (``covariates``)."""
        return {"columns": [c.to_plain() for c in self.columns]}

    @classmethod
    def from_plain(cls, value: Mapping[str, Any]) -> CovariateEncoding:
        cols = []
        for c in plain(value)["columns"]:
            if c["kind"] == "numeric":
                cols.append(Column(c["name"], "numeric", float(c["mean"]), float(c["std"]), float(c["min"]),
                                   float(c["max"])))
            else:
                cols.append(Column(c["name"], "categorical", levels=tuple(str(v) for v in c["levels"])))
        return cls(tuple(cols))

    def vector(self, values: Mapping[str, Any], where: str = "") -> torch.Tensor:
        """``(K,)`` float32 of one subject's ``values`` (a row of the table, or a sampler's request); ``where``
        names the row in a refusal. Values are assumed checked (:meth:`check_value`)."""
        out: list[float] = []
        for c in self.columns:
            v = values[c.name]
            if c.kind == "numeric":
                out.append((float(v) - c.mean) / c.std)
            else:
                out += [1.0 if str(v) == level else 0.0 for level in c.levels]
        out.append(1.0)
        return torch.tensor(out, dtype=torch.float32)

    def values(self, vector: torch.Tensor) -> dict[str, Any]:
        """The values a ``(K,)`` vector of :meth:`vector` encodes (its inverse): numbers de-normalised (rounded to
        6 significant digits), the level of each one-hot block; an empty dict for the null covariates."""
        v = [float(x) for x in vector.reshape(-1)]
        if len(v) != self.width:
            raise ValueError(f"a covariate vector of this encoding has {self.width} entries, got {len(v)}")
        if v[-1] == 0.0:  # presence 0: the null covariates (a guidance-dropped condition)
            return {}
        out: dict[str, Any] = {}
        i = 0
        for c in self.columns:
            if c.kind == "numeric":
                out[c.name] = float(f"{v[i] * c.std + c.mean:.6g}")
                i += 1
            else:
                block = v[i : i + len(c.levels)]
                out[c.name] = c.levels[max(range(len(block)), key=block.__getitem__)]
                i += len(c.levels)
        return out

    def null(self) -> torch.Tensor:
        """The null covariates ``(K,)``: zeros, presence 0."""
        return torch.zeros(self.width, dtype=torch.float32)

    def check_value(self, key: str, name: str, value: Any) -> Any:
        """A value a sampler asks for: a number within the training range, or a level seen in training.

        Raises:
            ConfigError: naming ``key``, the value, the trained range or levels and a fix.
        """
        column = {c.name: c for c in self.columns}.get(name)
        if column is None:
            raise ConfigError(key, value, f"this model was trained on the covariates {self.names}, not {name!r}",
                              f"pass covariates.<name>=value for {', '.join(self.names)}")
        if column.kind == "categorical":
            if str(value) not in column.levels:
                raise ConfigError(key, value, f"is not a level this model was trained on ({list(column.levels)})",
                                  f"use one of {', '.join(column.levels)}")
            return str(value)
        number = _number(value)
        if number is None or not (column.lo <= number <= column.hi):
            raise ConfigError(key, value, f"is outside the range this model was trained on "
                              f"[{column.lo:g}, {column.hi:g}]", f"use a number in [{column.lo:g}, {column.hi:g}]")
        return number


def parse_covariates(value: Any, key: str = "data.covariates") -> list[tuple[str, str | None]]:
    """``data.covariates`` (null, ``[]`` or a list of ``name`` / ``name:numeric`` / ``name:categorical``) as
    ``[(name, kind or None), ...]``; ``[]`` means off.

    Raises:
        ConfigError: not a list of such names, or a name twice.
    """
    value = plain(value)
    fix = f"e.g. {key}=[age,sex] (or age:numeric, sex:categorical), or {key}=[] for none"
    if value is None:
        return []
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise ConfigError(key, value, "must be a list of column names of the participants table", fix)
    out: list[tuple[str, str | None]] = []
    for item in value:
        if not isinstance(item, str) or not item.strip():
            raise ConfigError(key, value, f"{item!r} is not a column name", fix)
        name, _, kind = item.strip().partition(":")
        if kind and kind not in KINDS:
            raise ConfigError(key, value, f"{item!r}: the kind {kind!r} is neither numeric nor categorical", fix)
        if name == ID_COLUMN:
            raise ConfigError(key, value, f"{ID_COLUMN} names the subjects; it is not a covariate", fix)
        if name in [n for n, _ in out]:
            raise ConfigError(key, value, f"{name!r} is listed twice", fix)
        out.append((name, kind or None))
    return out


def estimated_width(value: Any, phantom: bool) -> int:
    """``K`` of ``data.covariates`` without reading a table (the preflight's model): exact for the phantom, and
    for a table one entry per column (a categorical column of L levels has L − 1 more: ``(L − 1) · 4 · channels[0]``
    parameters more: :func:`table_width` counts them where the table can be read). 0: no covariates."""
    names = parse_covariates(value)
    if not names:
        return 0
    if phantom:
        return sum(1 if PHANTOM_COVARIATES[n][0] == "numeric" else len(PHANTOM_COVARIATES[n][1])
                   for n, _ in names if n in PHANTOM_COVARIATES) + 1
    return len(names) + 1


def table_width(value: Any, table_path: str | Path, subjects: Sequence[str], val_fraction: float,
                seed: int) -> int | None:
    """``K`` of ``data.covariates`` as the data module fits it: the encoding of the training split of ``subjects``
    (:func:`~voxdiff.data.split.split_subjects`) in the table at ``table_path``, each categorical column one entry
    per training level. None when the table or the split cannot be made here (another machine's path, a table the
    run will refuse with the file named): :func:`estimated_width` then."""
    names = parse_covariates(value)
    if not names:
        return 0
    try:
        train, val = split_subjects(list(subjects), val_fraction, seed)
        encoding = fit_encoding(read_table(table_path), str(table_path), names, [subjects[i] for i in train],
                                [subjects[i] for i in val])
    except (DataError, ConfigError, OSError, ValueError):
        return None
    return encoding.width


def read_table(path: str | Path) -> dict[str, dict[str, str]]:
    """The rows of a participants table: ``{participant_id: {column: value}}``.

    Raises:
        DataError: no such file, no ``participant_id`` column, an id twice, a row of another length.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no participants table there; data.covariates needs one (tab-separated, a "
                        f"{ID_COLUMN} column naming the subject folders). Fix: write it, name another with "
                        "data.covariates_table=PATH, or set data.covariates=[]")
    with path.open(newline="", encoding="utf-8-sig") as f:
        rows = list(csv.reader(f, delimiter="\t"))
    if not rows or ID_COLUMN not in [h.strip() for h in rows[0]]:
        raise DataError(f"{path}: the header has no {ID_COLUMN} column (a BIDS participants.tsv is tab-separated; "
                        f"header: {rows[0] if rows else []}). Fix: add a {ID_COLUMN} column naming the subject folders")
    header = [h.strip() for h in rows[0]]
    table: dict[str, dict[str, str]] = {}
    for line, row in enumerate(rows[1:], start=2):
        if not any(cell.strip() for cell in row):
            continue
        if len(row) != len(header):
            raise DataError(f"{path}, line {line}: {len(row)} tab-separated values, the header has {len(header)}. "
                            "Fix: one value per column, separated by tabs")
        values = {h: cell.strip() for h, cell in zip(header, row, strict=True)}
        subject = values[ID_COLUMN]
        if subject in table:
            raise DataError(f"{path}, line {line}: subject {subject} appears twice. Fix: one row per subject")
        table[subject] = values
    return table


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def fit_encoding(table: Mapping[str, Mapping[str, str]], source: str, names: Sequence[tuple[str, str | None]],
                 train: Sequence[str], val: Sequence[str]) -> CovariateEncoding:
    """The encoding of ``names`` from the ``train`` subjects' rows; every subject of ``train`` and ``val`` is
    checked. ``source`` names the table in refusals.

    Raises:
        DataError: naming the file, the subject and the column (see the module docstring).
    """
    columns = set().union(*(row.keys() for row in table.values())) if table else set()
    subjects = [*train, *val]
    missing_subjects = [s for s in subjects if s not in table]
    if missing_subjects:
        raise DataError(f"{source}: subject {missing_subjects[0]} has no row ({len(missing_subjects)} subject(s) "
                        f"missing: {', '.join(missing_subjects[:5])}). Fix: add a row with {ID_COLUMN} "
                        f"{missing_subjects[0]}, or remove that subject folder")
    out = []
    for name, kind in names:
        if name not in columns:
            raise DataError(f"{source}: no column {name!r} (data.covariates lists it; the columns are "
                            f"{sorted(columns - {ID_COLUMN})}). Fix: add the column, or remove {name} from "
                            "data.covariates")
        for s in subjects:
            if table[s][name].strip().lower() in MISSING:
                raise DataError(f"{source}: subject {s} has no value in column {name!r} "
                                f"({table[s][name]!r}). Fix: fill it in, or remove that subject")
        numbers = {s: _number(table[s][name]) for s in subjects}
        if kind is None:
            kind = "numeric" if any(v is not None for v in numbers.values()) else "categorical"
        if kind == "numeric":
            bad = [s for s in subjects if numbers[s] is None]
            if bad:
                raise DataError(f"{source}: subject {bad[0]} has {table[bad[0]][name]!r} in the numeric column "
                                f"{name!r}. Fix: write a number there, or declare the column categorical "
                                f"(data.covariates=[{name}:categorical, ...])")
            values = np.array([numbers[s] for s in train], dtype=np.float64)
            std = float(values.std())
            if not std > 0:
                raise DataError(f"{source}: column {name!r} has the value {values[0]:g} for every training subject: "
                                f"it tells the model nothing. Fix: remove {name} from data.covariates")
            out.append(Column(name, "numeric", float(values.mean()), std, float(values.min()), float(values.max())))
        else:
            levels = tuple(sorted({table[s][name] for s in train}))
            unseen = [s for s in val if table[s][name] not in levels]
            if unseen:
                raise DataError(f"{source}: subject {unseen[0]} (validation) has the level "
                                f"{table[unseen[0]][name]!r} in column {name!r}, which no training subject has "
                                f"(levels {list(levels)}). Fix: correct it, or give a training subject that level")
            if len(levels) < 2:
                raise DataError(f"{source}: column {name!r} has the one level {levels[0]!r} in training: it tells "
                                f"the model nothing. Fix: remove {name} from data.covariates")
            out.append(Column(name, "categorical", levels=levels))
    return CovariateEncoding(tuple(out))


@dataclass(frozen=True)
class SubjectCovariates:
    """A data module's covariates: the encoding fitted on its training split, each subject's ``(K,)`` vector and
    its values in the table (what sampling starts from); ``donors`` (a negative control, :meth:`shuffled`): the
    subject whose vector each subject trains with."""

    encoding: CovariateEncoding
    vectors: dict[str, torch.Tensor]
    values: dict[str, dict[str, str]]
    donors: dict[str, str] | None = None

    @property
    def trained_values(self) -> dict[str, dict[str, str]]:
        """Each subject's values as its vector encodes them: its own, or (:meth:`shuffled`) its donor's. The pairs
        a model trains on: an evaluation reads a shuffled control against the chance relation they hold."""
        donors = self.donors or {}
        return {s: self.values[donors.get(s, s)] for s in self.values}

    def shuffled(self, seed: int) -> SubjectCovariates:
        """A negative control: every subject gets another subject's vector (a random permutation without fixed
        points); the encoding and the values stay."""
        import random

        names = sorted(self.vectors)
        rng = random.Random(seed)
        while True:
            order = names[:]
            rng.shuffle(order)
            if all(a != b for a, b in zip(names, order, strict=True)):
                donors = dict(zip(names, order, strict=True))
                return SubjectCovariates(self.encoding, {a: self.vectors[b] for a, b in donors.items()}, self.values,
                                         donors)


def subject_covariates(columns: Sequence[tuple[str, str | None]], table: Mapping[str, Mapping[str, str]],
                       source: str, train: Sequence[str], val: Sequence[str]) -> SubjectCovariates:
    """:func:`fit_encoding` on ``train`` (every subject of ``train`` and ``val`` checked), and each subject's vector
    and values.

    Raises:
        DataError: as :func:`fit_encoding`.
    """
    encoding = fit_encoding(table, source, columns, train, val)
    names = [*train, *val]
    return SubjectCovariates(encoding, {s: encoding.vector(table[s]) for s in names},
                             {s: {c: table[s][c] for c in encoding.names} for s in names})


def phantom_table(subjects: Sequence[str], seeds: Sequence[int]) -> dict[str, dict[str, str]]:
    """The phantom's participants table (:func:`voxdiff.data.phantom.phantom_covariates`) as rows of text, as a
    ``participants.tsv`` holds them."""
    rows = {}
    for subject, seed in zip(subjects, seeds, strict=True):
        values = phantom_covariates(seed)
        rows[subject] = {ID_COLUMN: subject, **{k: str(v) for k, v in values.items()}}
    return rows


def write_table(path: str | Path, table: Mapping[str, Mapping[str, str]]) -> Path:
    """Write ``table`` as a tab-separated participants table (``participant_id`` first), atomically."""
    columns = [ID_COLUMN] + sorted({k for row in table.values() for k in row} - {ID_COLUMN})
    text = io.StringIO(newline="")
    writer = csv.writer(text, delimiter="\t", lineterminator="\n")
    writer.writerow(columns)
    for row in table.values():
        writer.writerow([row.get(c, "n/a") for c in columns])
    return atomic_write(path, lambda f: f.write(text.getvalue().encode("utf-8")))


class WithCovariates(torch.utils.data.Dataset):
    """A dataset whose samples also carry ``"covariates": (K,)`` float32, looked up by the sample's ``subject``."""

    def __init__(self, dataset: Any, vectors: Mapping[str, torch.Tensor]) -> None:
        self.dataset = dataset
        self.vectors = dict(vectors)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict[str, Any]:
        sample = dict(self.dataset[index])
        sample["covariates"] = self.vectors[str(sample["subject"])].clone()
        return sample
