"""The covariate values ``sample.py`` and ``evaluate.py`` sample at: ``covariates.<name>=value`` on the command line.

A model trained with ``data.covariates`` samples each mask at its subject's own values (the data's participants
table, or the phantom's), each replaced by the value the command line requests: ``covariates.age=70
covariates.sex=F`` (the phantom's columns, ``age``, ``sex`` and ``lesion_load``, are declared in the commands'
configs; another table's column is added with ``+covariates.<name>=value``). A requested value must be one the model
was trained on: a number within the training split's range, a level seen in training
(:meth:`voxdiff.data.covariates.CovariateEncoding.check_value`). When every covariate is requested, the data's table
is not read. The values are encoded with the checkpoint's encoding (never one fitted on the command's data) and
written beside each generated volume (``<tag>_<subject>_covariates.json``). ``sample.py`` also takes one covariate
as a list, ``covariates.age=[50,60,70]``: every mask is sampled at each value with the same noise (counterfactuals:
what changes between the volumes is what the model makes of the value), written as ``sample_age50_<subject>...``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from omegaconf import DictConfig

from voxdiff.config import is_phantom_data, select
from voxdiff.data.covariates import MISSING, CovariateEncoding
from voxdiff.errors import ConfigError, plain

_NO_COVARIATES_FIX = "remove covariates.* (train with data.covariates=[...] to condition on what is known)"


def requested_covariates(cfg: DictConfig, encoding: CovariateEncoding | None, lists: bool = False) -> dict[str, Any]:
    """The values ``covariates.<name>=value`` asks for (nulls left out), each checked against ``encoding`` (the
    checkpoint's; None: a model without covariates, which takes none). With ``lists`` (``sample.py``) one covariate
    may be a list, ``covariates.age=[50,60,70]``, returned as a tuple of its checked values: every mask is sampled at
    each value with the same noise (:func:`covariate_points`).

    Raises:
        ConfigError: naming ``covariates.<name>``, the value and the fix: a name the model was not trained on, a
            number outside the training range, a level never seen in training, any value for a model without
            covariates; a list where the command takes one value, of fewer than two values, or beside another.
    """
    values = {str(k): plain(v) for k, v in (select(cfg, "covariates") or {}).items() if v is not None}
    if values and encoding is None:
        name = next(iter(values))
        raise ConfigError(f"covariates.{name}", values[name], "this model was trained without covariates",
                          _NO_COVARIATES_FIX)
    if not lists:
        one_value_each(cfg)
    swept = [name for name, v in values.items() if isinstance(v, list)]
    if len(swept) > 1:
        raise ConfigError(f"covariates.{swept[1]}", values[swept[1]], f"is a list beside covariates.{swept[0]}: one "
                          "covariate is swept at a time", f"give covariates.{swept[1]} one value, or sweep it alone")
    checked: dict[str, Any] = {}
    for name, v in values.items():
        key = f"covariates.{name}"
        if isinstance(v, list):
            if len(v) < 2:
                raise ConfigError(key, v, "a list samples every mask at each of its values and needs two or more",
                                  f"e.g. {key}=[50,70], or one value without brackets")
            checked[name] = tuple(encoding.check_value(key, name, x) for x in v)
            labels = [_label(name, x) for x in checked[name]]
            if len(set(labels)) < len(labels):
                raise ConfigError(key, v, f"repeats a value (as the file names write them: {', '.join(labels)})",
                                  "list each value once")
        else:
            checked[name] = encoding.check_value(key, name, v)
    return checked


def one_value_each(cfg: DictConfig) -> None:
    """``evaluate.py``'s ``covariates.<name>``: one value each (it sweeps a covariate by ``covariate_sweep``).

    Raises:
        ConfigError: naming the first covariate given as a list, and the fix.
    """
    for name, value in (select(cfg, "covariates") or {}).items():
        if isinstance(plain(value), list):
            raise ConfigError(f"covariates.{name}", plain(value), "takes one value in this command",
                              f"give one value; evaluate.py sweeps a covariate with covariate_sweep={name} "
                              "(counterfactual=true: the same noise at each value), sample.py takes a list")


def covariate_points(requested: Mapping[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The values a ``sample.py`` call samples each mask at, from :func:`requested_covariates` with ``lists``:
    ``[("", requested)]`` without a list; with ``covariates.age=(50.0, 70.0)``, ``[("age50", {..., "age": 50.0}),
    ("age70", {..., "age": 70.0})]``: a file-name suffix and the one-value request of each."""
    swept = next((name for name, v in requested.items() if isinstance(v, tuple)), None)
    if swept is None:
        return [("", dict(requested))]
    return [(_label(swept, v), {**requested, swept: v}) for v in requested[swept]]


def _label(name: str, value: Any) -> str:
    """The file-name suffix of a covariate value: ``age50``, ``age62.5``, ``sexF``."""
    return f"{name}{value:g}" if isinstance(value, float) else f"{name}{value}"


def recorded_request(cfg: DictConfig, hyper_parameters: Mapping[str, Any]) -> dict[str, Any]:
    """:func:`requested_covariates` against the encoding a checkpoint's hyper-parameters record (``covariates``;
    none: a model without covariates), before the model is built (a list taken: ``evaluate.py`` refuses one in its
    static checks, :func:`one_value_each`)."""
    recorded = hyper_parameters.get("covariates")
    return requested_covariates(cfg, CovariateEncoding.from_plain(recorded) if recorded else None, lists=True)


def without_table(saved: Mapping[str, Any], encoding: CovariateEncoding | None,
                  requested: Mapping[str, Any]) -> dict[str, Any]:
    """The stored run config for the command's data module: with every covariate requested, ``data.covariates``
    emptied (the data's table is not needed); else as stored. The phantom keeps them: they shape its anatomy (and
    its masks), which the real volumes an evaluation compares with must have."""
    saved = dict(saved)
    data = saved.get("data") or {}
    if encoding is not None and set(encoding.names) <= set(requested) and data and not is_phantom_data(data):
        saved["data"] = {**data, "covariates": []}
    return saved


def covariate_rows(encoding: CovariateEncoding | None, table: Mapping[str, Mapping[str, Any]],
                   subjects: Sequence[str], requested: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    """The covariate values of each sample: its subject's row of ``table`` (the data module's
    ``covariate_values``), overridden by ``requested``. None for a model without covariates.

    Raises:
        ConfigError: a subject without a value for a covariate that was not requested, or whose level the model
            was never trained on (naming ``covariates.<name>`` and the subject).
    """
    if encoding is None:
        return None
    rows = []
    for subject in subjects:
        own = table.get(str(subject), {})
        row: dict[str, Any] = {}
        for column in encoding.columns:
            name = column.name
            if name in requested:
                row[name] = requested[name]
                continue
            value = own.get(name)
            if value is None or str(value).strip().lower() in MISSING:
                raise ConfigError(f"covariates.{name}", None, f"subject {subject} has no {name} in the data's "
                                  "participants table, and the command line asks for none",
                                  f"pass covariates.{name}=VALUE (or +covariates.{name}=VALUE)")
            if column.kind == "categorical" and str(value) not in column.levels:
                raise ConfigError(f"covariates.{name}", value, f"subject {subject}'s level is not one this model was "
                                  f"trained on ({list(column.levels)})", f"pass covariates.{name}=LEVEL")
            row[name] = str(value) if column.kind == "categorical" else float(value)
        rows.append(row)
    return rows


def covariate_vectors(encoding: CovariateEncoding | None, rows: Sequence[Mapping[str, Any]] | None
                      ) -> torch.Tensor | None:
    """``(B, K)`` float32 of ``rows`` with the checkpoint's encoding; None without covariates."""
    if encoding is None or rows is None:
        return None
    return torch.stack([encoding.vector(row) for row in rows])
