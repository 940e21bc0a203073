"""``python evaluate.py ckpt_path=PATH [n=8] ...``: how good is a trained checkpoint?

compose → validate → read the checkpoint (its step and SHA-256) → take the real volumes of a split (the
validation subjects of the data the command names: ``data.root=DIR``, a latent run's ``data.latent_dir=DIR``, the
built-in phantom where the run trained on it, or with ``data.from_checkpoint=true`` the folder the checkpoint
names; a latent run's stage 1: ``encoding.checkpoint=PATH`` or ``encoding.from_checkpoint=true``, as in
``sample.py`` and :mod:`voxdiff.cli.checkpoint_paths`) → then

* a diffusion checkpoint: ``n`` samples with the run's sampler (DDIM, or Euler for rectified flow; with
  ``guidance_scale``, or ``autoguide_scale`` and the run's guide snapshot) and the EMA weights, conditioned on those
  subjects' masks (in turn, when ``n`` exceeds them), decoded through the encoding (as ``sample.py`` does) →
  diversity, paired fidelity, intensity statistics, MMD and Fréchet distances (:mod:`voxdiff.evaluation`);
* a VQ-VAE (stage-1) checkpoint: reconstructions of the real images → SSIM, PSNR, MS-SSIM, codebook usage;

→ ``metrics.json`` and ``report.html`` (one self-contained page) in ``<run dir of the checkpoint>/eval/<time>/``
(or ``out_dir=DIR``), with the generated NIfTI files (source affine) and montages under ``samples/``; the data and
stage-1 weights used are recorded there (``data``, ``stage1_weights``). Nothing is written anywhere else.

Exit codes: 0 done; 2 the config was refused.
"""

from __future__ import annotations

import datetime as dt
import functools
import json
import math
import time
from pathlib import Path
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from omegaconf import DictConfig, OmegaConf, open_dict

from voxdiff.checkpoint import CONFIG_KEY, KINDS, checkpoint_kind
from voxdiff.cli.devices import pick_device
from voxdiff.cli.exit_codes import hydra_main, refusals
from voxdiff.cli.covariate_args import (
    covariate_rows,
    covariate_vectors,
    one_value_each,
    requested_covariates,
    without_table,
)
from voxdiff.cli.sample import (
    _CKPT_FIX,
    _datamodule,
    available_host_bytes,
    check_each,
    checked,
    chunk_memory,
    measured_memory,
    ready,
    release,
    start_measuring,
)
from voxdiff.cli.sample import validate as validate_sampling
from voxdiff.config import is_phantom_data, plain
from voxdiff.data.phantom import COVARIATE_EFFECTS, ventricle_voxels
from voxdiff.errors import ConfigError, boolean, integer, number, one_of
from voxdiff.units import GiB
from voxdiff.files import check_output
from voxdiff.files import load_file
from voxdiff.evaluation.features import build_extractors, file_sha256
from voxdiff.evaluation.metrics import (
    MS_SSIM_PRESETS,
    check_volume_shape,
    describe,
    fit_probe,
    group_slopes,
    pearson,
    slope,
    slopes_effect,
)
from voxdiff.evaluation.pipeline import (
    DENOISE_AT,
    DEFINITIONS,
    Drawn,
    denoising_figures,
    diffusion_figures,
    figure,
    histogram_section,
    lesion_section,
    load_real,
    montage_section,
    noise_batches,
    vqvae_figures,
    vqvae_reconstructions,
)
from voxdiff.evaluation.report import (
    data_uri,
    interval_text,
    loss_curve_png,
    read_loss_log,
    render_html,
    render_sweep_html,
    scatter_png,
    sweep_png,
    write_outputs,
)
from voxdiff.evaluation.guidance_sweep import label_number, recipes, seed_order, show, summarise, train_seeds
from voxdiff.evaluation.uncertainty import (
    METHODS,
    MIN_RESAMPLES,
    Bootstrap,
    correlation_of,
    mean_of,
    slope_of,
    thin_tails,
)
from voxdiff.viz import save_montage


def eval_dir(ckpt_path: Any, out_dir: Any, log_dir: Any, stamp: str) -> str:
    """The ``${voxdiff.eval_dir:...}`` resolver: ``out_dir`` if set, else ``<run dir>/eval/<stamp>`` where the run
    directory holds ``checkpoints/<ckpt>`` (else the checkpoint's folder), else ``<log_dir>/evaluate/<stamp>``."""
    if out_dir not in (None, ""):
        return str(out_dir)
    if ckpt_path not in (None, "") and not OmegaConf.is_list(ckpt_path) and not isinstance(ckpt_path, list):
        parent = Path(str(ckpt_path)).parent
        run_dir = parent.parent if parent.name == "checkpoints" else parent
        return str(run_dir / "eval" / stamp)
    return str(Path(str(log_dir)) / "evaluate" / stamp)


if not OmegaConf.has_resolver("voxdiff.eval_dir"):
    OmegaConf.register_new_resolver("voxdiff.eval_dir", eval_dir)


def validate(cfg: DictConfig) -> None:
    """Static checks of an evaluation config (those of ``sample.py``, and the evaluation's own).

    A guidance scale or interval or ``ckpt_path`` given as a list (a sweep, a comparison: :func:`swept`) is
    validated at each of its values.

    Raises:
        ConfigError: naming the key, the value and a fix.
    """
    sweep = swept(cfg)
    if sweep is not None:
        key, values = sweep
        recipe = swept_recipe(cfg)
        if recipe is not None:  # a sweep over one recipe's runs: each run swept in turn
            for run in recipe:
                validate(_at(cfg, COMPARED, run))
            _once(COMPARED, recipe)
            return
        values = runs(values) if key == COMPARED else values  # recipes: each run of each
        for value in values:
            validate(_at(cfg, key, value))
        _once(key, values)
        return
    validate_sampling(cfg)
    one_value_each(cfg)
    check_output("out_dir" if cfg.get("out_dir") else "paths.log_dir", cfg.paths.run_dir, folder=True,
                 fix="choose a folder this user can write to (out_dir=DIR)")
    if cfg.n < 2:
        raise ConfigError("n", cfg.n, "diversity and distribution figures need at least 2 samples", "e.g. n=8")
    for key, minimum in (("montages", 0), ("histogram_bins", 2)):
        integer(key, cfg.get(key), minimum=minimum, example=max(minimum, 4))
    if cfg.get("diversity_pairs") is not None:
        integer("diversity_pairs", cfg.diversity_pairs, minimum=1,
                fix="e.g. diversity_pairs=1000 (random pairs of each set), or null for every pair")
    if cfg.get("ms_ssim") not in MS_SSIM_PRESETS:
        raise ConfigError("ms_ssim", cfg.get("ms_ssim"), "unknown MS-SSIM settings",
                          f"use one of {', '.join(MS_SSIM_PRESETS)} (voxdiff: any axis >= 20; wdm: WDM's, axes >= 112)")
    seed = cfg.get("random_features_seed")
    if seed is not None:
        integer("random_features_seed", seed, minimum=0,
                fix="e.g. random_features_seed=0 (null: no random-network features)")
    stage1 = cfg.get("stage1_ckpt")
    if stage1 is not None and not Path(str(stage1)).is_file():
        raise ConfigError("stage1_ckpt", stage1, "no such checkpoint file",
                          "point it at a VQ-VAE run's checkpoints/last.ckpt, or stage1_ckpt=null")
    nearest = cfg.get("nearest_training", True)
    if not isinstance(nearest, bool):
        raise ConfigError("nearest_training", nearest, "must be true or false",
                          "use nearest_training=true (each volume's nearest training volume: the memorisation "
                          "check) or nearest_training=false (the training split is not read)")
    counterfactual = cfg.get("counterfactual", False)
    if not isinstance(counterfactual, bool):
        raise ConfigError("counterfactual", counterfactual, "must be true or false",
                          "use counterfactual=true (with covariate_sweep=NAME) or counterfactual=false")
    if counterfactual and cfg.get("covariate_sweep") is None:
        raise ConfigError("counterfactual", counterfactual, "draws each mask at every value of the swept covariate, "
                          "and no covariate is swept", "add covariate_sweep=age (a covariate of the model), or use "
                          "counterfactual=false")
    control = cfg.get("control_ckpt")
    if control is not None and not Path(str(control)).is_file():
        raise ConfigError("control_ckpt", control, "no such checkpoint file", "point it at the negative control's "
                          "checkpoint (a run without data.covariates, or with shuffled ones), or control_ckpt=null")
    bootstrap_settings(cfg)
    medicalnet = cfg.get("medicalnet") or {}
    if medicalnet.get("weights") is not None and not medicalnet.get("sha256"):
        raise ConfigError("medicalnet.sha256", medicalnet.get("sha256"), "a MedicalNet weights file needs its SHA-256",
                          "pass medicalnet.sha256=$(sha256sum FILE | cut -d' ' -f1) of the file you trust")


def bootstrap_settings(cfg: DictConfig) -> Bootstrap | None:
    """The figures' intervals as ``cfg.bootstrap`` asks (``resamples``, ``level``, ``method``, ``expand``; seeded by
    ``seed``); None for ``bootstrap.resamples=0``.

    Raises:
        ConfigError: naming the ``bootstrap.*`` key, its value and a fix.
    """
    values = dict(plain(cfg.get("bootstrap")) or {})
    default = Bootstrap()
    unknown = sorted(set(values) - {"resamples", "level", "method", "expand"})
    if unknown:
        raise ConfigError(f"bootstrap.{unknown[0]}", values[unknown[0]], "is not a bootstrap setting",
                          "remove it; the settings are expand, level, method, resamples (seeded by seed)")
    resamples = integer("bootstrap.resamples", values.get("resamples", default.resamples), minimum=0,
                        fix="e.g. bootstrap.resamples=1000, or 0 for no intervals")
    if 0 < resamples < MIN_RESAMPLES:
        raise ConfigError("bootstrap.resamples", resamples, f"is too few for the tails of an interval (at least "
                          f"{MIN_RESAMPLES})", "use bootstrap.resamples=1000, or 0 for no intervals")
    level = number("bootstrap.level", values.get("level", default.level), lo=0, hi=1, lo_open=True, hi_open=True,
                   example=0.95)
    method = one_of("bootstrap.method", values.get("method", default.method), METHODS)
    expand = boolean("bootstrap.expand", values.get("expand", default.expand),
                     "bootstrap.expand=true widens each interval for its sets' sizes (the default); false gives "
                     "SciPy's interval as it is")
    return Bootstrap(resamples, level, method, int(cfg.seed), expand) if resamples else None


def _correlated(drawn: Drawn, name: str, series: tuple[Sequence[float], Sequence[float]], of: str = "generated"
                ) -> dict[str, Any]:
    """Pearson's r of a series ``(values, measures)`` of the set ``of``, with its interval (``drawn``)."""
    return drawn.with_interval(name, pearson(*series), correlation_of(*series, of))


#: the sampling settings a list of values sweeps: one evaluation at each (``autoguide_scale=[1,1.1,1.25]``,
#: ``num_inference_steps=[10,25,50]``, ``eta=[0,1]``, ``unweight=[true,false]``: a mask model's weight undone or not)
SWEEPABLE = ("guidance_scale", "autoguide_scale", "num_inference_steps", "eta", "unweight")
_EXAMPLES = {"num_inference_steps": "[10,25,50]", "eta": "[0,0.5,1]",  # where a scale's example is not one
             "unweight": "[true,false]"}
#: the guidance interval a list of intervals sweeps (``'guidance_interval=[[0,1],[0,0.2]]'``)
INTERVALS = "guidance_interval"
#: the swept settings whose values are labelled by name, not as numbers
NAMED = (INTERVALS, "unweight")
#: the checkpoints a list compares: one evaluation of each with the same masks, noise and covariates
#: (``'ckpt_path=[a.ckpt,b.ckpt]'``); a list of lists compares recipes, each trained several times
#: (``'ckpt_path=[[a1.ckpt,a2.ckpt,a3.ckpt],[b1.ckpt,b2.ckpt,b3.ckpt]]'``)
COMPARED = "ckpt_path"


def _once(key: str, values: Sequence[Any]) -> None:
    """Refuse a sweep or a comparison that lists a value (a checkpoint) twice."""
    if len({_shown(key, Path(str(v)).resolve() if key == COMPARED else v) for v in values}) != len(values):
        raise ConfigError(key, values, "repeats a value: each is evaluated once",
                          f"list each once, e.g. {key}=[A.ckpt,B.ckpt]" if key == COMPARED else
                          f"list each once, e.g. {key}=[[0,1],[0,0.2]]" if key == INTERVALS else
                          f"list each value once, e.g. {key}={_EXAMPLES.get(key, '[1,1.1,1.25]')}")


def swept_recipe(cfg: DictConfig) -> list[Any] | None:
    """``ckpt_path=[[a1,a2,...]]``, one recipe's runs, which a guidance setting given as a list is swept over
    (each run evaluated at each value); None for any other ``ckpt_path``."""
    value = cfg.get(COMPARED)
    if OmegaConf.is_list(value) and len(value) == 1 and OmegaConf.is_list(value[0]):
        return list(plain(value[0]))
    return None


def _one_run_refused(key: str, values: Sequence[Any], few: Sequence[Any]) -> ConfigError:
    return ConfigError(key, values, f"lists a recipe of {len(few)} run ({list(few)}): a recipe's runs say how far "
                       "training varies, which one run cannot", "train the recipe again with other seeds "
                       "(train.py seed=1, 2, ...) and list each run's checkpoint, or compare the checkpoints "
                       "alone: 'ckpt_path=[A.ckpt,B.ckpt]'")


def is_recipes(values: Sequence[Any]) -> bool:
    """Whether a comparison's ``ckpt_path`` lists recipes (lists of runs' checkpoints) rather than checkpoints."""
    return any(isinstance(v, (list, tuple)) for v in values)


def runs(values: Sequence[Any]) -> list[Any]:
    """Every checkpoint a comparison evaluates: ``values`` as they are, or each recipe's runs in turn."""
    return [run for v in values for run in v] if is_recipes(values) else list(values)


def _is_swept(key: str, value: Any) -> bool:
    """Whether ``key=value`` asks for one evaluation per value: a list (of intervals, for the guidance interval,
    which is a list itself)."""
    if not OmegaConf.is_list(value):
        return False
    return key != INTERVALS or (len(value) > 0 and all(OmegaConf.is_list(v) for v in value))


def _shown(key: str, value: Any) -> str:
    """A swept value as the sweep prints and names it: ``1.25``, ``[0, 0.2]``, a checkpoint's path."""
    if key == INTERVALS:
        return "[" + ", ".join(f"{float(v):g}" for v in value) + "]"
    if key == "unweight":
        return str(value).lower()
    return str(value) if key == COMPARED else f"{float(value):g}"


def swept(cfg: DictConfig) -> tuple[str, list[Any]] | None:
    """A guidance scale or interval (a sweep) or ``ckpt_path`` (a comparison) given as a list: ``(key, values)``;
    None: one evaluation. With ``ckpt_path`` one recipe (:func:`swept_recipe`), the guidance setting given as a list
    is swept over its runs: ``(key, values)`` of that setting.

    Raises:
        ConfigError: two of them given as lists (but one recipe and a setting), fewer than two values, one recipe
            and nothing swept, a recipe of one run.
    """
    lists = [k for k in (*SWEEPABLE, INTERVALS, COMPARED) if _is_swept(k, cfg.get(k))]
    if not lists:
        return None
    recipe = swept_recipe(cfg)
    if recipe is not None and len(lists) > 1:  # a guidance setting swept over one recipe's runs
        lists.remove(COMPARED)
        if len(recipe) < 2:
            raise _one_run_refused(COMPARED, plain(cfg.get(COMPARED)), recipe)
    elif recipe is not None:
        raise ConfigError(COMPARED, plain(cfg.get(COMPARED)), "lists one recipe and sweeps nothing: a recipe is "
                          "compared with another, or a guidance setting is swept over its runs",
                          "add another recipe ('ckpt_path=[[a1,a2],[b1,b2]]'), or sweep a setting over this one "
                          "(e.g. 'guidance_scale=[1,1.2]')")
    key = lists[0]
    if len(lists) > 1:
        raise ConfigError(lists[1], plain(cfg.get(lists[1])), f"is swept beside {key}: one list at a time",
                          f"give {lists[1]} one value (or null), or sweep it alone" if lists[1] != COMPARED else
                          f"sweep {key} over one checkpoint, or over one recipe's runs ('{COMPARED}=[[a1,a2,...]]')")
    values = list(plain(cfg.get(key)))
    if key == COMPARED and is_recipes(values):
        if not all(isinstance(v, list) for v in values):
            raise ConfigError(key, values, "mixes recipes (lists of runs) with single checkpoints",
                              "give every recipe as a list of its runs' checkpoints, e.g. "
                              "'ckpt_path=[[a1.ckpt,a2.ckpt],[b1.ckpt,b2.ckpt]]', or list checkpoints alone")
        few = next((v for v in values if len(v) < 2), None)
        if few is not None:
            raise _one_run_refused(key, values, few)
    if len(values) < 2:
        raise ConfigError(key, values, "a sweep or a comparison needs at least two values",
                          "e.g. 'ckpt_path=[A.ckpt,B.ckpt]', or one without brackets" if key == COMPARED else
                          "e.g. 'guidance_interval=[[0,1],[0,0.2]]', or one interval [lo,hi]" if key == INTERVALS else
                          f"e.g. {key}={_EXAMPLES.get(key, '[1,1.1,1.25]')}, or one value without brackets")
    return key, values


def _at(cfg: DictConfig, key: str, value: Any, out: Path | None = None, index: int = 0,
        folder: str | None = None) -> DictConfig:
    """The sweep's evaluation at ``key=value``: the command's config with that value, written into
    ``<out>/<key>_<value>`` (an interval ``[lo, hi]``: ``<key>_<lo>-<hi>``; a checkpoint of a comparison:
    ``<out>/ckpt_<index + 1>``, or ``<out>/<folder>`` where given; ``out``: the sweep's folder; None: left as it
    is)."""
    point = cfg.copy()
    with open_dict(point):
        point[key] = value
        if out is not None:
            folder = folder or (f"ckpt_{index + 1}" if key == COMPARED else _folder(key, value))
            point.paths.output_dir = str(out / folder)
    return point


def _folder(key: str, value: Any) -> str:
    """The folder of a sweep's evaluation at ``key=value``: ``<key>_<value>``, an interval's ``<key>_<lo>-<hi>``."""
    if key == INTERVALS:
        return f"{key}_{'-'.join(f'{float(v):g}' for v in value)}"
    return f"{key}_{_shown(key, value)}"


def _run_name(path: Any) -> str:
    """A checkpoint's run directory's name (its folder's, where it is not in a ``checkpoints/`` folder)."""
    parent = Path(str(path)).parent
    return (parent.parent if parent.name == "checkpoints" else parent).name


def _checkpoint_label(index: int, record: Mapping[str, Any]) -> str:
    """How a comparison names its ``index``-th checkpoint: ``"<k>: <run dir>/<file>, step <step>"``."""
    path = Path(record["checkpoint"]["path"])
    return f"{index + 1}: {_run_name(path)}/{path.name}, step {record['checkpoint']['global_step']}"


def _runs_named(paths: Sequence[Any], records: Sequence[Mapping[str, Any]]) -> str:
    """A recipe's runs as a comparison names them: ``"<n> runs (<run dir>, ...; seeds <s>, ...)"``, the training
    seeds where every run's evaluation (``records``) recorded one (a multirun's run folders are ``0``, ``1``, ...)."""
    seeds = train_seeds(records)
    told = f"; seeds {', '.join(map(str, seeds))}" if seeds and None not in seeds else ""
    return f"{len(paths)} runs ({', '.join(_run_name(p) for p in paths)}{told})"


def _recipe_label(index: int, paths: Sequence[Any], records: Sequence[Mapping[str, Any]]) -> str:
    """How a comparison of recipes names its ``index``-th recipe: ``"<k>: "`` and :func:`_runs_named`."""
    return f"{index + 1}: {_runs_named(paths, records)}"


def evaluate_sweep(cfg: DictConfig, key: str, values: Sequence[Any]) -> dict[str, Any]:
    """Evaluate ``cfg.ckpt_path`` at each of ``values`` of the guidance setting ``key`` (a sweep), or each checkpoint
    of ``ckpt_path`` (``key`` :data:`COMPARED`: a comparison), with the same masks, noise and covariates (the same
    ``seed``): every scale (every checkpoint) is checked as the model and its guide can take it before any is
    sampled, then each is a whole evaluation in ``<out>/<key>_<value>/`` (a checkpoint: ``<out>/ckpt_<k>/``;
    ``metrics.json``, ``report.html``, samples), and ``sweep.json`` and ``sweep.html`` in ``<out>`` put their figures
    side by side (:func:`voxdiff.evaluation.guidance_sweep.summarise`: the scale or checkpoint each figure prefers,
    and those a paired bootstrap cannot tell apart from it). A compared checkpoint samples as it was trained to,
    but for what the command sets. Recipes (``values`` lists of runs' checkpoints) are compared as
    :func:`voxdiff.evaluation.guidance_sweep.recipes` says, each run in ``<out>/recipe_<g>/run_<k>/``, each
    recipe's runs listed in the first recipe's seed order where they hold the same seeds
    (:func:`~voxdiff.evaluation.guidance_sweep.seed_order`). A sweep over one recipe's runs
    (``ckpt_path=[[a1,a2,...]]``, :func:`swept_recipe`) evaluates every run at every value, each in
    ``<out>/<key>_<value>/run_<k>/``: a value's figure is the mean of its runs', its intervals and ties over the
    runs (the same at every value) and the volumes.
    Returns the sweep's record plus ``{"json", "html"}`` paths.

    Raises:
        ConfigError: not a diffusion checkpoint, a scale the checkpoint cannot sample with (both before anything is
            sampled), a compared checkpoint whose data split draws other subjects than the first's (before it
            samples: its figures would not be of the same masks), or as :func:`evaluate`.
    """
    comparing = key == COMPARED
    recipe = None if comparing else swept_recipe(cfg)  # a sweep over one recipe's runs
    grouped = comparing and is_recipes(values)
    groups = [list(v) for v in values] if grouped else []
    for path in runs(values) if comparing else recipe or [cfg.ckpt_path]:
        header = load_file(Path(str(path)), "ckpt_path", _CKPT_FIX, mmap=True)
        kind = checkpoint_kind(header)
        del header
        if kind != "diffusion" and (comparing or recipe):
            raise ConfigError(COMPARED, str(path), f"is {KINDS[kind]}; a comparison evaluates diffusion checkpoints",
                              "list diffusion runs' checkpoints (evaluate a VQ-VAE alone)")
        if kind != "diffusion":
            raise ConfigError(key, values, f"sweeps how a diffusion checkpoint samples, and ckpt_path is "
                              f"{KINDS[kind]}", f"give {key} one value (or none), or point ckpt_path at a diffusion "
                              "run's checkpoint")
    out = Path(cfg.paths.output_dir)
    if recipe is not None:  # every run at every value: value i's runs are points[i * R:(i + 1) * R]
        points = [_at(_at(cfg, COMPARED, run), key, v, out, folder=f"{_folder(key, v)}/run_{k + 1}")
                  for v in values for k, run in enumerate(recipe)]
        flat = [v for v in values for _ in recipe]
    else:
        folders = [f"recipe_{g + 1}/run_{k + 1}" for g, group in enumerate(groups) for k in range(len(group))]
        flat = runs(values) if comparing else list(values)
        points = [_at(cfg, key, v, out, i, folders[i] if grouped else None) for i, v in enumerate(flat)]
    device = pick_device(cfg.device)
    what = ("comparison of recipes" if grouped else "comparison" if comparing else
            f"sweep of {key} over {len(recipe)} runs" if recipe else f"sweep of {key}")
    shown = [_shown(key, v) for v in flat]
    print(f"[voxdiff] {what}: checking {', '.join(dict.fromkeys(shown))} "
          f"{'' if comparing else 'against the checkpoint ' if not recipe else 'against each run '}before any is "
          "sampled", flush=True)
    if comparing:  # each its own checkpoint, read, checked and let go in turn
        for point in points:
            checked(point, device)
    elif recipe:  # each run's checkpoint read once, checked at every value
        for k in range(len(recipe)):
            _differ(key, values, check_each(points[k::len(recipe)], device), recipe[k])
    else:
        _differ(key, values, check_each(points, device), cfg.ckpt_path)
    records, splits = [], TrainingSplits()  # the training split read once, for every evaluation that shares it
    for i, (value, point) in enumerate(zip(shown, points, strict=True)):
        print(f"[voxdiff] {what}: {key}={value} ({i + 1} of {len(flat)}) into {point.paths.output_dir}", flush=True)
        records.append(evaluate(point, subjects=records[0]["real_subjects"] if (comparing or recipe) and records
                                else None, splits=splits))
    if grouped:  # each recipe's runs together, listed in the first recipe's seed order where they pair by it
        starts = np.cumsum([0, *map(len, groups)])
        by_group = [records[a:b] for a, b in zip(starts[:-1], starts[1:])]
        order = seed_order(by_group)
        if order is not None:
            by_group = [[g[k] for k in each] for g, each in zip(by_group, order)]
            groups = [[g[k] for k in each] for g, each in zip(groups, order)]
            records, flat = [r for g in by_group for r in g], runs(groups)
    elif recipe:
        by_group = [records[i * len(recipe):(i + 1) * len(recipe)] for i in range(len(values))]
    run_labels = [_checkpoint_label(i, r) for i, r in enumerate(records)] if comparing else []
    if grouped:
        labels = [_recipe_label(g, group, by_group[g]) for g, group in enumerate(groups)]
    elif comparing:
        labels = run_labels
    else:
        labels = [_shown(key, v) for v in values] if key in NAMED else [float(v) for v in values]
    if grouped or recipe:  # a figure is the mean of its runs', its intervals and ties over runs and volumes
        summary = recipes(labels, by_group, bootstrap_settings(cfg), swept=None if comparing else key)
    else:
        summary = summarise(key, labels, records, bootstrap_settings(cfg))  # the ties by a paired bootstrap
    first = records[0]
    shared = ("seed", "conditioned_on", "covariates") if comparing else tuple(first["sampling"])
    group_of = [labels[g] for g, group in enumerate(by_group) for _ in group] if grouped or recipe else []
    record = {"checkpoint": None if comparing or recipe else first["checkpoint"],
              "evaluated_at": dt.datetime.now().isoformat(timespec="seconds"),
              "data": first["data"], "split": first["split"], "n_generated": first["n_generated"],
              "sampling": {k: v for k, v in first["sampling"].items()  # what every evaluation shares
                           if k in shared and k not in (key, "autoguide_ckpt", "memory_gib")},
              **summary,
              "evaluations": [{key: str(v) if comparing else v, **({"label": label} if comparing else {}),
                               **({"recipe": group_of[i]} if grouped else {"run": i % len(recipe) + 1} if recipe
                                  else {}),
                               "checkpoint": r["checkpoint"], "metrics": r["json"], "report": r["html"]}
                              for i, (v, label, r) in enumerate(zip(flat, run_labels or flat, records))]}
    if grouped:
        meta = {"compared": "; ".join(labels), "intervals over": summary["intervals_over"],
                "sets": f"{first['n_generated']} generated by each run from the same masks, noise and "
                        f"covariates, {first['n_real']} real (split={first['split']})"}
    elif comparing:
        meta = {"compared": "; ".join(f"{label} ({r['checkpoint']['path']})" for label, r in zip(labels, records)),
                "sets": f"{first['n_generated']} generated by each checkpoint from the same masks, noise and "
                        f"covariates, {first['n_real']} real (split={first['split']})"}
    elif recipe:
        meta = {"recipe": _runs_named(recipe, by_group[0]),
                "swept": f"{key} = {', '.join(dict.fromkeys(shown))}: every run at each, with the same masks, noise "
                         "and covariates", "intervals over": summary["intervals_over"],
                "sets": f"{first['n_generated']} generated by each run at each value, {first['n_real']} real "
                        f"(split={first['split']})"}
    else:
        meta = {"checkpoint": f"{first['checkpoint']['path']} (step {first['checkpoint']['global_step']})",
                "swept": f"{key} = {', '.join(shown)}: the same masks, noise and covariates at each",
                "sets": f"{first['n_generated']} generated at each value, {first['n_real']} real "
                        f"(split={first['split']})"}
    def report(r: Mapping[str, Any]) -> str:
        return str(Path(r["html"]).relative_to(out))

    # a column links its evaluation's report, or each of its runs' reports
    reports: list[Any] = [[report(r) for r in g] for g in by_group] if grouped or recipe else list(map(report, records))
    title = ("voxdiff comparison of recipes" if grouped else "voxdiff comparison of checkpoints" if comparing else
             f"voxdiff guidance sweep over a recipe's runs: {key}" if recipe else f"voxdiff guidance sweep: {key}")
    page = render_sweep_html(title, meta, summary, reports, sweep_png(summary))
    json_path, html_path = write_outputs(out, record, page, names=("sweep.json", "sweep.html"))
    print(f"[voxdiff] {what}: wrote {json_path} and {html_path}", flush=True)
    if comparing:  # the labels once; the figures name each checkpoint (recipe) by its number
        for label in labels:
            print(f"[voxdiff]   {label}", flush=True)

    def short(value: Any) -> str:
        return label_number(value) if comparing else show(value)

    for name, f in summary["figures"].items():
        if f["best"] is not None:
            ties = (f"; not told apart from it ({f['tie_rule']}): {', '.join(map(short, f['tied']))}"
                    if f.get("tied") else "")
            print(f"[voxdiff]   {name}: " + "  ".join(f"{short(v)}: {x:.4g}" for v, x in zip(labels, f["values"]))
                  + f"  (prefers {short(f['best'])}{ties})", flush=True)
    _say_thin_tails([t for f in summary["figures"].values() for t in f.get("ci_tail_resamples", []) if t is not None],
                    cfg)
    return {**record, "json": str(json_path), "html": str(html_path)}


def _differ(key: str, values: Sequence[Any], samplers: Sequence[Any], ckpt: Any) -> None:
    """Refuse a sweep two of whose values sample the checkpoint ``ckpt`` alike (``samplers``: each value's
    :class:`~voxdiff.step.sampling.SamplerChoice`): they would be evaluated twice, for figures that differ only
    by chance."""
    for i, a in enumerate(samplers):
        j = next((j for j in range(i) if samplers[j] == a), None)
        if j is None:
            continue
        why = ("it has no mask weight to undo (a bravo model, or a mask model trained with diffusion.mask_weight=0)"
               if key == "unweight" else f"both sample it as {a.describe()}")
        raise ConfigError(key, list(values), f"{key}={_shown(key, values[j])} and {key}={_shown(key, values[i])} "
                          f"sample {ckpt} alike: {why}", f"evaluate it once, without {key} given as a list")


def _say_thin_tails(tails: Sequence[float], cfg: DictConfig) -> None:
    """Print :func:`voxdiff.evaluation.uncertainty.thin_tails`'s note of intervals drawn from few resamples."""
    note = thin_tails(tails, int(cfg.bootstrap.resamples))
    if note:
        print(f"[voxdiff] note: {note}", flush=True)


def _split(dm: Any, split: str):
    from torch.utils.data import ConcatDataset

    dm.setup("fit")
    return dm.val_dataset if split == "val" else ConcatDataset([dm.val_dataset, dm.train_dataset])


def _denoised(cfg: DictConfig, system: Any, sampler: Any, real: Any, device: Any, precision: Any,
              table: Mapping[str, Mapping[str, Any]], requested: Mapping[str, Any]
              ) -> tuple[dict[float, Any] | None, str | None]:
    """A mask model's one-step estimates of the real masks noised at each fraction of :data:`DENOISE_AT`
    (:meth:`voxdiff.step.TrainStep.denoised`, the weight undone as ``sampler`` undoes it, each subject's own
    covariates, or the ``requested`` ones where the table lacks them), ``batch_size`` masks at a time on the device,
    seeded by ``seed``: ``({fraction: (R, 1, D, H, W) uint8}, None)``; ``(None, why)`` where there are none (an
    image model, ``mode=bravo``; a covariate no real subject has a value of, as in a sweep of it). One UNet forward a
    chunk, as one sampling step without guidance runs (not traced by the preflight)."""
    import torch

    if system.mode != "seg":
        return None, None
    encoding = system.covariate_encoding
    try:
        rows = covariate_rows(encoding, table, real.subjects, {})
    except ConfigError:  # a subject without a value of its own: what the command asked for, as it samples
        try:
            rows = covariate_rows(encoding, table, real.subjects, requested)
        except ConfigError as e:
            return None, f"the real masks' own covariates are not all known ({e}), so none was denoised"
    covariates = covariate_vectors(encoding, rows)
    chunk, out = int(cfg.batch_size), {}
    for k, fraction in sorted(enumerate(DENOISE_AT), key=lambda kf: kf[1]):  # k seeds it, the noise orders it
        generator = torch.Generator(device=device).manual_seed(int(cfg.seed) * 1_000_003 + 7_919 * (k + 1))
        parts = []
        for i in range(0, len(real), chunk):
            batch = {"mask": real.masks[i:i + chunk].to(device)}  # a mask model's target: its image is not read
            cov = None if covariates is None else covariates[i:i + chunk].to(device)
            with precision.autocast():
                parts.append(system.step.denoised(batch, fraction, generator, covariates=cov,
                                                  unweight=sampler.unweights).to(torch.uint8).cpu())
        out[fraction] = torch.cat(parts)
    return out, None


def _generate(cfg: DictConfig, system: Any, sampler: Any, real: Any, device: Any, precision: Any,
              rows: list[dict[str, Any]] | None = None, tag: str = "eval",
              guide: Any = None, cycle: int | None = None) -> tuple[Any, list[int], list[Path]]:
    """``n`` samples conditioned on the real masks in turn (and on ``rows[i]``'s covariates, written beside each
    when the model has covariates), autoguided by ``guide`` when given; writes NIfTI + montage per sample.
    ``cycle`` (counterfactuals: the number of masks): sample ``i`` is drawn with the noise of sample ``i % cycle``
    (:func:`~voxdiff.evaluation.pipeline.noise_batches`); without it each batch has its own."""
    import torch
    from tqdm.auto import tqdm

    # deferred: Lightning costs seconds at start-up; a refused config exits before it is imported
    from voxdiff.lightning.samples import save_samples

    n, out = int(cfg.n), Path(cfg.paths.output_dir) / "samples"
    sources = [i % len(real) for i in range(n)]
    generated = torch.empty((n, *real.images.shape[1:]))  # filled batch by batch: never a second copy (no cat)
    pngs: list[Path] = []
    for idx, key in tqdm(noise_batches(n, int(cfg.batch_size), cycle), desc=f"[voxdiff] {sampler.sampler}",
                         unit="batch"):
        src = [sources[i] for i in idx]
        generator = torch.Generator(device=device).manual_seed(int(cfg.seed) * 1_000_003 + key)
        used = None if rows is None or system.covariate_encoding is None else [rows[i] for i in idx]
        with precision.autocast():
            x = system.generate(real.masks[src], num_inference_steps=sampler.num_inference_steps,
                                generator=generator, use_ema=bool(cfg.use_ema), eta=sampler.eta,
                                guidance_scale=sampler.guidance_scale, batch_size=int(cfg.batch_size),
                                covariates=covariate_vectors(system.covariate_encoding, used), guide=guide,
                                autoguide_scale=sampler.autoguide_scale,
                                guidance_interval=sampler.guidance_interval,
                                unweight=sampler.unweights).float().cpu()
        generated[idx[0]:idx[-1] + 1] = x
        names = [f"{real.subjects[s]}_s{i:03d}" for s, i in zip(src, idx)]
        pngs += save_samples(out, tag, system.mode, x, real.masks[src], real.images[src], real.affines[src], names,
                             covariates=used)
    return generated, sources, pngs


def check_host_memory(cfg: DictConfig, volume: tuple[int, ...], real_subjects: int) -> int:
    """The host memory an evaluation's volumes take, all float32 of shape ``volume`` ``(C, D, H, W)``: the
    ``real_subjects`` real ones (image and mask each) and the ``n`` generated ones (twice with a negative control,
    ``control_ckpt``, whose ``n`` are held beside them), refused above what this machine has available
    (:func:`voxdiff.cli.sample.available_host_bytes`) before the real set is loaded or anything sampled. Returns the
    bytes.

    Raises:
        ConfigError: naming ``n``, with the largest ``n`` that fits.
    """
    sets = 2 if cfg.get("control_ckpt") is not None else 1
    per_volume = 4 * math.prod(volume)
    real = 2 * real_subjects * per_volume
    need = int(cfg.n) * per_volume * sets + real
    available = available_host_bytes()
    if need > available:
        control = ", twice: the negative control's too" if sets == 2 else ""
        most = (available - real) // (per_volume * sets)
        raise ConfigError("n", cfg.n, f"holds {need / GiB:.3g} GiB of volumes in host memory ({per_volume / 2**20:.3g} "
                          f"MiB each: {cfg.n} generated{control}, and {real_subjects} real subjects' images and masks)"
                          f", more than the {available / GiB:.3g} GiB available here",
                          (f"use n={most} or fewer, or " if most >= 2 else "use ")
                          + f"a node with more memory (n=2 needs {(2 * per_volume * sets + real) / GiB:.3g} GiB)")
    return need


def _swept(cfg: DictConfig, encoding: Any) -> Any:
    """The covariate column ``covariate_sweep=NAME`` names (None without a sweep).

    Raises:
        ConfigError: the model has no such covariate.
    """
    name = cfg.get("covariate_sweep")
    if name is None:
        return None
    column = {c.name: c for c in (encoding.columns if encoding is not None else ())}.get(str(name))
    if column is None:
        raise ConfigError("covariate_sweep", name, "is not a covariate of this model "
                          f"({encoding.names if encoding is not None else 'it has none'})",
                          "name one of its covariates, or covariate_sweep=null")
    return column


def _sweep(column: Any, n: int, masks: int, counterfactual: bool = False) -> list[dict[str, Any]]:
    """The ``n`` samples' requested values of the swept ``column`` (``[{}] * n`` without a sweep), spread so that
    the value does not follow the mask: sample ``i`` uses mask ``i % masks``, and a mask's features (its subject's
    head, where its lesions sit) would otherwise move with the value in the figure of the model and of its control
    alike.

    * categorical: its levels in turn by cycle over the masks (``(i // masks) % levels``): with ``n`` a multiple of
      ``masks x levels`` every mask is drawn at every level equally often;
    * numeric: ``n`` values evenly over its training range, in a fixed shuffled order (seed 0), so that no mask
      gets the low or the high ones (drawn in order, mask ``j`` of each cycle would always get the ``j``-th lowest);
      ``counterfactual``: ``n // masks`` values evenly over the range, one per cycle (``i // masks``), so every mask
      is drawn at every value (:func:`_check_counterfactual` has checked ``n``).
    """
    if column is None:
        return [{} for _ in range(n)]
    if column.kind == "categorical":
        return [{column.name: column.levels[(i // masks) % len(column.levels)]} for i in range(n)]
    if counterfactual:
        step = (column.hi - column.lo) / (n // masks - 1)
        return [{column.name: round(column.lo + (i // masks) * step, 6)} for i in range(n)]
    step = (column.hi - column.lo) / max(n - 1, 1)
    order = np.random.default_rng(0).permutation(n)
    return [{column.name: round(column.lo + int(k) * step, 6)} for k in order]


def _check_counterfactual(column: Any, n: int, masks: int) -> int:
    """``counterfactual=true``: every one of the split's ``masks`` drawn at every swept value needs ``n`` a
    multiple of ``masks`` with at least 2 values (a categorical column: each level equally often); the samples use
    the split's first ``n`` masks in turn, so with ``n >= 2 · masks`` all of them. Returns ``masks``, the cycle.

    Raises:
        ConfigError: naming ``n`` and the values that work.
    """
    numeric = column.kind == "numeric"
    unit = masks if numeric else masks * len(column.levels)
    if n % unit or n < 2 * masks:
        what = f"n / {masks} values, at least 2" if numeric else f"each of its {len(column.levels)} levels alike"
        least = max(unit, 2 * masks)
        raise ConfigError("n", n, f"with counterfactual=true draws each of the split's {masks} masks at every value "
                          f"of {column.name} ({what}), so it must be a multiple of {unit}, at least {least}",
                          f"use n={least} (or {least + unit}, ...)")
    return masks


#: training volumes compared at once by the nearest-training figures
NEAREST_CHUNK = 8


class TrainingSplits:
    """The training splits a sweep's evaluations compare their volumes against (the nearest-training figures): each
    read by the first evaluation that needs it and kept in host memory for the others, where it takes at most half
    of the memory available when it is read (:func:`~voxdiff.cli.sample.available_host_bytes`); a larger one is
    read again by each evaluation, and the log says so. A split is known by everything its volumes are built from
    (``identity``: the stored data config, the command's data settings, the stage-1 weights), its subjects and which
    volume it gives (mask or image), so the checkpoints of a comparison share one only where they read the same."""

    def __init__(self) -> None:
        self.kept: dict[str, list[tuple[Any, list[str]]]] = {}  # name -> the chunks as the first read yielded them
        self.too_large: set[str] = set()


def _training_volumes(cfg: DictConfig, dm: Any, mode: str, splits: TrainingSplits | None = None,
                      identity: str = "") -> tuple[Any, str | None]:
    """``(chunks, None)``: the training split of ``dm`` streamed for
    :func:`~voxdiff.evaluation.pipeline.nearest_figures` as ``(volumes (m, 1, D, H, W), subjects)`` of at most
    :data:`NEAREST_CHUNK` (masks for ``seg``, images for ``bravo``), read once when iterated, or as ``splits`` kept
    it from a sweep's earlier evaluation of the same ``identity`` (:class:`TrainingSplits`); ``(None, why)`` where
    the figures are not computed."""
    if not cfg.get("nearest_training", True):
        return None, "nearest_training=false: the training split was not read"
    if str(cfg.split) != "val":
        return None, f"split={cfg.split}: the real volumes include the training subjects, so none is held out"
    dataset, key = dm.train_dataset, "mask" if mode == "seg" else "image"
    if len(dataset) == 0:
        return None, "the training split holds no subject"
    name = json.dumps([identity, key, list(getattr(dm, "train_subjects", []))])
    if splits is not None and name in splits.kept:
        print(f"[voxdiff] nearest training volume: the {len(dataset)} subjects of the training split as an earlier "
              "evaluation of the sweep read them (kept in memory)", flush=True)
        return iter(splits.kept[name]), None
    first = dataset[0]
    if key not in first:
        return None, f"the training split's samples carry no {key} volume (latents): nothing to compare in voxels"
    import torch
    from tqdm.auto import tqdm

    # deferred: the preflight package costs a third of a second at start-up, which a refused config should not pay
    from voxdiff.preflight.resources import loader_rate

    # how long the reads take, from the loader's measured rate (voxdiff.preflight.resources): a real data set's
    # training split read uncached is minutes at 160x256x256
    data = {"_target_": type(dm).__name__, "root": getattr(dm, "root", None), "cache": getattr(dm, "cache", "none")}
    rate = loader_rate(data, 0, tuple(first[key].shape[1:]))
    expected = f", about {len(dataset) / rate:.0f} s at the measured {rate:.3g} volumes/s" if rate else ""
    keep, kept_as = False, ""
    if splits is not None:  # a sweep: kept for its other evaluations where it fits
        size, available = 4 * math.prod(first[key].shape) * len(dataset), available_host_bytes()
        keep = name not in splits.too_large and size <= available // 2
        kept_as = (f"; kept in memory for the sweep's other evaluations ({size / GiB:.3g} GiB)" if keep else
                   f"; read again by each of the sweep's evaluations: its {size / GiB:.3g} GiB are more than half "
                   f"the {available / GiB:.3g} GiB of host memory available")
        if not keep:
            splits.too_large.add(name)
    print(f"[voxdiff] nearest training volume: reading the {len(dataset)} subjects of the training split{expected} "
          f"(nearest_training=false skips it){kept_as}", flush=True)

    def chunks() -> Any:
        read = []
        for start in tqdm(range(0, len(dataset), NEAREST_CHUNK), desc="[voxdiff] training split", unit="chunk"):
            # the first subject was read above (its shape): not read again
            items = [first if i == 0 else dataset[i] for i in range(start, min(start + NEAREST_CHUNK, len(dataset)))]
            chunk = torch.stack([item[key] for item in items]).float(), [str(item["subject"]) for item in items]
            if keep:
                read.append(chunk)
            yield chunk
        if keep:  # only a split read to its end is kept
            splits.kept[name] = read

    return chunks(), None


def _training_pairs(saved: dict[str, Any], cfg: DictConfig, weights: str | None) -> tuple[list[dict[str, str]], Any]:
    """The training split of the run whose stored config is ``saved`` (built as the command builds its data
    module): the covariate values each of its subjects trained with (``covariate_trained_values``: another
    subject's under ``data.shuffle_covariates``), and their real images ``(N, 1, D, H, W)``."""
    import torch

    dm, _ = _datamodule(saved, cfg, weights)
    dm.setup("fit")
    items = [dm.train_dataset[i] for i in range(len(dm.train_dataset))]
    return ([dm.covariate_trained_values[str(item["subject"])] for item in items],
            torch.stack([item["image"] for item in items]).float())


def _effect_figures(key: str, series: dict[str, tuple[list[float], list[float]]], cycle: int,
                    control_path: str, control_pairs: tuple[list[float], list[float]] | None = None,
                    drawn: Drawn | None = None) -> dict[str, Any]:
    """The counterfactual figures of one covariate (``key``: ``covariate_<name>_<measure>``): the effect within each
    mask (sample ``i`` is mask ``i % cycle``) of the generated ``series`` and of the negative control's where it was
    drawn, and the real subjects' slope, with the generated effect's ratio to it; ``control_pairs`` (the values the
    control's training images trained with, and their measures): the chance slope those pairs hold. ``drawn``: each
    effect's interval over the masks (the real slope's over the real subjects), its standard error kept."""
    out: dict[str, Any] = {}
    drawn = drawn or Drawn({}, None)
    real = slope(*series["real"]) if "real" in series else None
    if real is not None:
        out[f"{key}_effect_real"] = figure(f"{key}_effect_real", drawn.with_interval(
            f"{key}_effect_real", real, slope_of(*series["real"])))
    if control_pairs is not None:
        out[f"{key}_effect_control_data"] = figure(f"{key}_effect_control_data", slope(*control_pairs),
                                                   checkpoint=control_path)
    for name, tag in (("generated", "generated"), ("negative control", "control")):
        if name not in series:
            continue
        values, measured = series[name]
        slopes = group_slopes(values, measured, [i % cycle for i in range(len(values))])  # each mask's
        effect = slopes_effect(slopes)
        if name == "generated" and real is not None and math.isfinite(real["value"]) and real["value"] != 0:
            effect["ratio_to_real"] = effect["value"] / real["value"]
        out[f"{key}_effect_{tag}"] = figure(f"{key}_effect_{tag}", drawn.with_interval(
            f"{key}_effect_{tag}", effect, mean_of(slopes, "masks")),
            **({"checkpoint": control_path} if tag == "control" else {}))
    return out


def _covariate_figures(cfg: DictConfig, phantom: bool, system: Any, sampler: Any, real: Any,
                       generated: Any, rows: list[dict[str, Any]] | None, table: dict[str, Any],
                       device: Any, precision: Any, drawn: Drawn, cycle: int | None = None,
                       extractors: Sequence[Any] = ()) -> tuple[dict[str, Any], dict[str, str], list[Any]]:
    """Is each covariate obeyed? On a phantom run (``phantom``: trained and evaluated on the built-in phantom), for
    each of its covariates that changes the phantom's anatomy (:data:`~voxdiff.data.phantom.COVARIATE_EFFECTS`: age
    the ventricles, sex the head): Pearson's r between the value each sample was drawn at (a categorical one as its
    level's index, e.g. F 0, M 1) and the measure of what it changes, the same for the real images and their own
    values, and for ``control_ckpt`` (a negative control: sampled once with the same masks, noise and values); with
    a scatter per covariate for the report. ``cycle`` (``counterfactual=true``: the number of masks, each drawn at
    every value of the swept covariate with the same noise): the swept covariate's effect within each mask too
    (:func:`~voxdiff.evaluation.metrics.paired_effect`), against the real subjects' slope (``_effect_`` figures).
    On any bravo run, phantom or not, each numeric or two-level covariate is also read by a probe fitted on the
    real volumes' features, of the first of ``extractors`` in :data:`PROBE_FEATURES`' order (:func:`_probe_figures`)."""
    figures: dict[str, Any] = {}
    absent: dict[str, str] = {}
    if rows is None or system.mode != "bravo":
        return figures, absent, []
    effects = {name: COVARIATE_EFFECTS[name] for name in rows[0] if name in COVARIATE_EFFECTS} if phantom else {}
    if not effects:
        absent["covariate_age_ventricles_generated"] = (
            "measured on a phantom run (bravo) with the covariate age or sex only: the phantom's ventricles "
            "widen with age, its head is larger for M (the probe's figures, covariate_<name>_probe_..., read any "
            "covariate of any data)")
    columns = system.covariate_encoding.columns
    probed = [c.name for c in columns if c.kind == "numeric" or len(c.levels) == 2]
    levels = {c.name: list(c.levels) for c in columns if c.kind == "categorical"}
    if not effects and not probed:
        return figures, absent, []

    def coded(name: str, value: Any) -> float:
        return float(levels[name].index(value)) if name in levels else float(value)

    def axis(name: str) -> str:
        return f"{name} (requested; real: the subject's)" + (
            f", levels {levels[name]} as 0..{len(levels[name]) - 1}" if name in levels else "")

    control = control_train = None
    control_path = cfg.get("control_ckpt")
    if control_path is not None:
        control_cfg = cfg.copy()
        with open_dict(control_cfg):
            control_cfg.ckpt_path = str(control_path)
            control_cfg.autoguide_ckpt = None  # autoguided as the model is, by its own run's guide snapshot
        # a control may have no covariates; it samples as the model did (its guide, if it has one, is its own)
        model, control_sampler, control_guide, _, control_saved, control_precision, control_weights, _ = ready(
            control_cfg, device, requested=False, sampler=sampler)
        encoding = model.covariate_encoding
        if encoding is not None and set(encoding.names) != set(rows[0]):
            raise ConfigError("control_ckpt", str(control_path), f"was trained with the covariates {encoding.names}, "
                              f"this model with {list(rows[0])}", "use a control with the same covariates "
                              "(shuffled) or none")
        print(f"[voxdiff] negative control {control_path}: sampling with the same masks, noise and covariates",
              flush=True)
        control, _, _ = _generate(cfg, model, control_sampler, real, device, control_precision, rows, tag="control",
                                  guide=control_guide, cycle=cycle)
        release(model, control_guide)
        if effects and cycle is not None and encoding is not None:  # the counterfactuals' control: what its
            # (phantom) training pairs hold; a real dataset's training split is not loaded for it
            control_train = _training_pairs(control_saved, control_cfg, control_weights)
    sections = []
    for name, (measure, of, label) in effects.items():
        key = f"covariate_{name}_{measure}"
        values = [coded(name, r[name]) for r in rows]
        series = {"generated": (values, [of(v) for v in generated])}
        figures[f"{key}_generated"] = figure(f"{key}_generated", _correlated(drawn, f"{key}_generated",
                                                                             series["generated"]))
        real_values = [coded(name, table[s][name]) for s in real.subjects]
        if len(real_values) >= 2:
            series["real"] = (real_values, [of(v) for v in real.images])
            figures[f"{key}_real"] = figure(f"{key}_real", _correlated(drawn, f"{key}_real", series["real"], "real"))
        if control is None:
            absent[f"{key}_control"] = ("no negative control: pass control_ckpt=PATH (a run without "
                                        "data.covariates, or with shuffled ones)")
        else:
            series["negative control"] = (values, [of(v) for v in control])
            figures[f"{key}_control"] = figure(f"{key}_control", _correlated(drawn, f"{key}_control",
                                                                             series["negative control"]),
                                               checkpoint=str(control_path))
        counterfactuals = cycle is not None and name == cfg.get("covariate_sweep")
        if counterfactuals:
            pairs = None if control_train is None else (
                [coded(name, v[name]) for v in control_train[0]], [of(v) for v in control_train[1]])
            figures.update(_effect_figures(key, series, cycle, str(control_path), pairs, drawn))
            if control is not None and pairs is None:
                absent[f"{key}_effect_control_data"] = ("the control was trained without covariates: its "
                                                        "training pairs hold no relation to read it against")
        png = scatter_png(series, axis(name), label,  # each mask's counterfactuals joined by a line
                          groups={k: [i % cycle for i in range(len(series[k][0]))]
                                  for k in ("generated", "negative control") if counterfactuals and k in series})
        sections.append((f"Covariates: is {name} obeyed?", f"{label} of each volume against the {name} it was "
                         "sampled at (generated, negative control) or has (real); r and N in the table",
                         [(data_uri(png), name)]))
    extractor = min((e for e in extractors if e.name.startswith(PROBE_FEATURES)), default=None,
                    key=lambda e: [e.name.startswith(p) for p in PROBE_FEATURES].index(True))
    volumes = {"real": real.images, "generated": generated, "control": control}

    @functools.cache  # each set's features once, for every covariate probed, and only where a probe is fitted
    def features(tag: str) -> Any:
        return extractor(volumes[tag], device=device)

    for name in probed:
        if extractor is None:
            absent[f"covariate_{name}_probe_generated"] = (
                "the probe reads a feature extractor's features, and none is on: random_features_seed=0 (or "
                "medicalnet.weights=, stage1_ckpt=)")
            continue
        more, missing, section = _probe_figures(name, axis(name), [coded(name, r[name]) for r in rows],
                                                [coded(name, table[s][name]) for s in real.subjects],
                                                features, extractor.label, control_path, drawn)
        figures.update(more)
        absent.update(missing)
        sections += section
    return figures, absent, sections


#: the fewest real volumes a probe is fitted on
PROBE_MIN_SUBJECTS = 8
#: the least leave-one-out r on the real volumes for the probe's reading of generated ones to be reported
PROBE_MIN_R = 0.5
#: the features a probe reads, the first of these extractors the evaluation has (``FeatureExtractor.name``
#: prefixes): MedicalNet's, trained on real medical volumes, then the run's VQ-VAE encoder's, then a random network's
#: (on 40 phantom subjects at 32x48x48 a probe on the random ResNet-10's 512 features read age at a leave-one-out r
#: of 0.68, one on the 64-bin intensity histogram at 0.24)
PROBE_FEATURES = ("medicalnet", "vqvae_encoder", "random_resnet10")


def _probe_figures(name: str, axis: str, values: list[float], real_values: list[float],
                   features: Callable[[str], Any], label: str, control_path: Any, drawn: Drawn | None = None
                   ) -> tuple[dict[str, Any], dict[str, str], list[Any]]:
    """Is covariate ``name`` obeyed, read by a probe (:func:`~voxdiff.evaluation.metrics.fit_probe`) fitted on the
    real volumes' features (``features(tag)``: ``(N, F)`` of the ``"real"``, ``"generated"`` or ``"control"``
    volumes; ``label`` says whose) and their own ``real_values``: r between the ``values`` the generated volumes
    (and the negative control's, drawn where ``control_path`` is set) were sampled at and the probe's reading of
    them (with its interval where ``drawn`` has a bootstrap: the probe held, the volumes resampled), beside the probe's
    leave-one-out r on the real volumes; a scatter of the three."""
    key = f"covariate_{name}_probe"
    if len(real_values) < PROBE_MIN_SUBJECTS:
        return {}, {f"{key}_generated": (
            f"the probe is fitted on the real volumes of the split: {len(real_values)} here, it needs "
            f"{PROBE_MIN_SUBJECTS} (a larger n, split=all, or a data set with more validation subjects)")}, []
    try:
        probe = fit_probe(features("real"), real_values)
    except ValueError as e:
        return {}, {f"{key}_generated": f"no probe could be fitted: {e}"}, []

    def labelled(tag: str, stats: dict[str, Any], **extra: Any) -> dict[str, Any]:
        generic = DEFINITIONS[f"covariate_probe_{tag}"][0]
        return figure(f"covariate_probe_{tag}", stats, label=generic.replace("Covariate", name, 1)
                      .replace("requested", f"requested {name}"), **extra)

    figures = {f"{key}_real": labelled("real", {"value": probe.loo_r, "n": probe.n, "alpha": probe.alpha,
                                                "features": label})}
    if not probe.loo_r >= PROBE_MIN_R:  # NaN too
        why = (f"the probe reads too little of {name} from the real volumes' features (leave-one-out r "
               f"{probe.loo_r:.2f} on {probe.n}, below {PROBE_MIN_R}): its reading of generated ones would mean "
               "nothing (more real volumes: a larger n with split=all)")
        return figures, {f"{key}_generated": why}, []
    series = {"generated": (values, probe(features("generated")).tolist()),
              "real": (real_values, list(probe.loo))}
    drawn = drawn or Drawn({}, None)
    figures[f"{key}_generated"] = labelled("generated", _correlated(drawn, f"{key}_generated", series["generated"]))
    absent = {}
    if control_path is None:
        absent[f"{key}_control"] = ("no negative control: pass control_ckpt=PATH (a run without data.covariates, "
                                    "or with shuffled ones)")
    else:
        series["negative control"] = (values, probe(features("control")).tolist())
        figures[f"{key}_control"] = labelled("control", _correlated(drawn, f"{key}_control",
                                                                   series["negative control"]),
                                             checkpoint=str(control_path))
    png = scatter_png(series, axis, f"{name} read by the probe (real: leave-one-out)")
    section = (f"Covariates: is {name} obeyed? (probe)", f"the probe's reading of each volume (a ridge regression on "
               f"its features, {label}, fitted on the {probe.n} real volumes) against the {name} it was sampled at "
               "(generated, negative control) or has (real, read by the probe fitted without it); r in the table",
               [(data_uri(png), f"{name} probe")])
    return figures, absent, [section]


def _diffusion(cfg: DictConfig, device: Any, subjects: Sequence[str] | None = None,
               splits: TrainingSplits | None = None) -> dict[str, Any]:
    system, sampler, guide, guide_path, saved, precision, weights, memory = ready(cfg, device)
    encoding = system.covariate_encoding
    requested = requested_covariates(cfg, encoding)
    swept = _swept(cfg, encoding)
    if swept is not None:  # the sweep gives its values, not the command line
        requested = {k: v for k, v in requested.items() if k != swept.name}
    stored = without_table(saved, encoding, {**requested, **({swept.name: None} if swept else {})})
    dm, data = _datamodule(stored, cfg, weights)
    dataset = _split(dm, str(cfg.split))
    ms_ssim = MS_SSIM_PRESETS[cfg.ms_ssim]
    volume = tuple(dataset[0]["image"].shape)
    check_volume_shape(volume[1:], ms_ssim)
    cycle = _check_counterfactual(swept, int(cfg.n), len(dataset)) if cfg.get("counterfactual") else None
    check_host_memory(cfg, volume, min(int(cfg.n), len(dataset)))
    real = load_real(dataset, int(cfg.n))
    if subjects is not None and real.subjects != list(subjects):
        raise ConfigError("ckpt_path", str(cfg.ckpt_path), f"draws its masks from other subjects ({real.subjects[:3]}"
                          f"...) than the comparison's first checkpoint ({list(subjects)[:3]}...): its data split "
                          "differs, and its figures would not be of the same masks", "compare checkpoints of one run, "
                          "or of runs with the same data settings (data.root, data.num_subjects, data.val_fraction, "
                          "data.split_seed), or evaluate each alone")
    extractors, absent = build_extractors(cfg.get("random_features_seed"), cfg.get("stage1_ckpt"),
                                          plain(cfg.get("medicalnet")))
    sources = [i % len(real) for i in range(int(cfg.n))]
    table = getattr(dm, "covariate_values", {})
    sweep = _sweep(swept, int(cfg.n), masks=len(real), counterfactual=cycle is not None)
    rows = None if encoding is None else [
        covariate_rows(encoding, table, [real.subjects[s]], {**requested, **sweep[i]})[0]
        for i, s in enumerate(sources)]
    t0 = time.perf_counter()
    generated, sources, pngs = _generate(cfg, system, sampler, real, device, precision, rows, guide=guide,
                                         cycle=cycle)
    t1 = time.perf_counter()
    denoised, not_denoised = _denoised(cfg, system, sampler, real, device, precision, table, requested)
    measured = measured_memory(device, memory)
    release(system, guide)  # the device is the feature extractors' and the negative control's from here on
    print(f"[voxdiff] {len(generated)} samples in {t1 - t0:.1f} s; computing the figures", flush=True)
    # trained and evaluated on the built-in phantom: its ventricles can be counted
    phantom = is_phantom_data(saved.get("data")) and cfg.data.get("root") is None
    drawn = Drawn({"generated": len(generated), "real": len(real), **({"masks": cycle} if cycle else {})},
                  bootstrap_settings(cfg))  # the intervals
    identity = json.dumps({"data": stored.get("data"), "command": plain(cfg.get("data")), "weights": weights},
                          sort_keys=True, default=str)  # what the split's volumes are built from
    training, not_nearest = _training_volumes(cfg, dm, system.mode, splits, identity)
    figures, more_absent = diffusion_figures(real, generated, sources, system.mode, extractors,
                                             bins=int(cfg.histogram_bins), device=str(device), ms_ssim=ms_ssim,
                                             ventricles=ventricle_voxels if phantom else None,
                                             diversity_pairs=cfg.get("diversity_pairs"), seed=int(cfg.seed),
                                             drawn=drawn, training=training)
    if not_nearest is not None:
        more_absent["nearest_training"] = not_nearest
    if denoised is not None:
        figures.update(denoising_figures(denoised, real, drawn))
    if not_denoised is not None:
        more_absent["denoised_dice"] = not_denoised
    cov_figures, cov_absent, cov_sections = _covariate_figures(cfg, phantom, system, sampler, real, generated, rows,
                                                               table, device, precision, drawn, cycle, extractors)
    figures.update(cov_figures)
    more_absent.update(cov_absent)
    what = "mask | real | generated" if system.mode == "bravo" else "real mask | generated mask"
    sections = [montage_section(pngs, int(cfg.montages), what), *cov_sections]
    if system.mode == "bravo":
        sections.append(histogram_section(real, generated, sources, int(cfg.histogram_bins)))
    else:
        sections.append(lesion_section(figures))
    return {
        "kind": "diffusion", "mode": system.mode, "figures": figures, "absent": {**absent, **more_absent},
        "sections": sections, "n_generated": len(generated), "real": real, "resamplers": drawn.resamplers,
        "resample_sizes": drawn.sizes,
        "sampler": sampler,
        "sampling": {"sampler": sampler.sampler, "num_inference_steps": sampler.num_inference_steps,
                     "eta": sampler.eta, "guidance_scale": sampler.guidance_scale,
                     "autoguide_scale": sampler.autoguide_scale,
                     "guidance_interval": list(sampler.guidance_interval),
                     "mask_weight_undone": sampler.mask_weight_undone,
                     **({"autoguide_ckpt": str(guide_path)} if guide_path is not None else {}),
                     "use_ema": bool(cfg.use_ema), "seed": int(cfg.seed), "batch_size": int(cfg.batch_size),
                     "counterfactual": cycle is not None,  # each mask's noise the same at every swept value
                     # GiB of device memory: predicted before loading (voxdiff.preflight.memory.predict_sampling);
                     # measured (max_memory_allocated) on a GPU only
                     "memory_gib": {"predicted": round(memory.peak / GiB, 4),
                                    **({"measured": round(measured / GiB, 4)} if measured is not None else {})},
                     "conditioned_on": [real.subjects[s] for s in sources],
                     **({"covariates": rows} if rows is not None else {})},
        "feature_extractors": {e.name: e.label for e in extractors},
        "seconds": {"generation": round(t1 - t0, 2), "figures": round(time.perf_counter() - t1, 2)},
        "data": data, "stage1_weights": weights, "train_seed": saved.get("seed"),
    }


def check_reconstruction_memory(cfg: DictConfig, device: Any, spec: Any, volume: tuple[int, ...], n: int) -> Any:
    """Predict the peak device memory of reconstructing ``batch_size`` volumes at once with a VQ-VAE of ``spec``
    (:func:`voxdiff.preflight.stage1.predict_reconstruction`), print it, and refuse it before the weights go to the
    device when it exceeds the budget, as ``sample.py`` does for sampling (:func:`voxdiff.cli.sample.chunk_memory`:
    ``batch_size=auto`` the largest up to ``n`` predicted to fit). Returns the prediction.

    Raises:
        ConfigError: naming ``batch_size`` (with the largest batch predicted to fit), else ``device``.
    """
    import torch

    # deferred: the prediction's tracer is only needed once a checkpoint is loaded
    from voxdiff.preflight.stage1 import predict_reconstruction
    from voxdiff.run.gpus import local_gpu

    device_type = torch.device(device).type
    gpu = local_gpu() if device_type == "cuda" else None

    @functools.cache  # the choice and the refusals ask for the same batches
    def predict(batch: int) -> Any:
        return predict_reconstruction(spec, batch, volume, device_type, gpu)

    report, budget, where = chunk_memory(cfg, device, predict, n, "reconstruction")
    if budget is None or report.required_bytes() <= budget:
        return report
    raise ConfigError("device", plain(cfg.device), f"reconstructing one volume of {'x'.join(map(str, volume))} is "
                      f"predicted to need {report.required_bytes() / GiB:.3g} GiB ({report.describe()}), more than "
                      f"the {where} {budget / GiB:.3g} GiB", f"use a device with "
                      f"{report.required_bytes() / GiB:.3g} GiB free")


def _vqvae(cfg: DictConfig, device: Any) -> dict[str, Any]:

    # deferred: Lightning costs seconds at start-up; a refused config exits before it is imported
    from voxdiff.lightning.systems import rebuild_system

    system, checkpoint, _ = rebuild_system(str(cfg.ckpt_path), "stage1", _CKPT_FIX)
    saved = checkpoint.get(CONFIG_KEY, {})
    dm, data = _datamodule(saved, cfg)
    dataset = _split(dm, str(cfg.split))
    ms_ssim = MS_SSIM_PRESETS[cfg.ms_ssim]
    volume = tuple(dataset[0]["image"].shape[1:])
    check_volume_shape(volume, ms_ssim)
    memory = check_reconstruction_memory(cfg, device, system.spec, volume, min(int(cfg.n), len(dataset)))
    real = load_real(dataset, int(cfg.n))
    system = system.to(device)
    start_measuring(device)
    t0 = time.perf_counter()
    recon, codes = vqvae_reconstructions(system, real, int(cfg.batch_size), device)
    measured = measured_memory(device, memory, "reconstruction")
    figures = vqvae_figures(real, recon, codes, system.spec.num_embeddings, ms_ssim, bootstrap_settings(cfg))
    out = Path(cfg.paths.output_dir) / "samples"
    pngs = [save_montage(out / f"recon_{s}.png", {"image": real.images[i, 0], "reconstruction": recon[i, 0],
                                                  "|difference|": (recon[i, 0] - real.images[i, 0]).abs()},
                         title=f"{s}: VQ-VAE reconstruction") for i, s in enumerate(real.subjects[: cfg.montages])]
    sections = [("Montages", "image | reconstruction | absolute difference, three mid-planes, grey scale [0, 1]",
                 [(data_uri(p), p.stem) for p in pngs]),
                histogram_section(real, recon, list(range(len(real))), int(cfg.histogram_bins), "reconstruction")]
    return {"kind": "vqvae", "mode": "reconstruction", "figures": figures, "absent": {}, "sections": sections,
            "n_generated": len(recon), "real": real, "sampling": None, "feature_extractors": {},
            # GiB of device memory: predicted before loading (voxdiff.preflight.stage1.predict_reconstruction);
            # measured (max_memory_allocated) on a GPU only
            "reconstruction": {"batch_size": int(cfg.batch_size),
                               "memory_gib": {"predicted": round(memory.peak / GiB, 4),
                                              **({"measured": round(measured / GiB, 4)} if measured is not None
                                                 else {})}},
            "seconds": {"figures": round(time.perf_counter() - t0, 2)}, "data": data, "stage1_weights": None}


#: the evaluation of each kind of checkpoint (:func:`voxdiff.checkpoint.checkpoint_kind`): generation for a diffusion
#: UNet, reconstructions for a stage 1
_EVALUATIONS = {"diffusion": _diffusion, "stage1": _vqvae}


def evaluate(cfg: DictConfig, subjects: Sequence[str] | None = None, splits: TrainingSplits | None = None
             ) -> dict[str, Any]:
    """Evaluate ``cfg.ckpt_path``; returns the ``metrics.json`` record plus ``{"json", "html"}`` paths and, for a
    diffusion checkpoint, ``resamplers`` (each figure's :class:`~voxdiff.evaluation.uncertainty.Resampler`, which a
    sweep compares its evaluations on) and ``resample_sizes`` (the sets they draw from); neither is written.

    A guidance scale or ``ckpt_path`` given as a list is a sweep or a comparison: :func:`evaluate_sweep`.
    ``subjects``: the real subjects a comparison's first checkpoint drew (a diffusion checkpoint whose split draws
    others is refused before it samples). ``splits``: the training splits a sweep's earlier evaluations read
    (:class:`TrainingSplits`), for a diffusion checkpoint's nearest-training figures.

    Raises:
        ConfigError: the checkpoint is not one of voxdiff's (of no kind in :data:`_EVALUATIONS`), or is refused
            when its system is rebuilt.
    """
    sweep = swept(cfg)
    if sweep is not None:
        return evaluate_sweep(cfg, *sweep)

    # deferred: Lightning costs seconds at start-up; a refused config exits before it is imported
    from voxdiff.lightning.trainer import configure_cpu_threads

    configure_cpu_threads()
    device = pick_device(cfg.device)
    ckpt_path = Path(str(cfg.ckpt_path)).resolve()
    header = load_file(ckpt_path, "ckpt_path", _CKPT_FIX, mmap=True)  # tensors stay on disk; one line if refused
    kind = checkpoint_kind(header)
    if kind not in _EVALUATIONS:
        raise ConfigError("ckpt_path", str(cfg.ckpt_path), f"is {KINDS[kind]}; evaluate.py needs "
                          + " or ".join(KINDS[k] for k in _EVALUATIONS), _CKPT_FIX)
    step, epoch = int(header.get("global_step", -1)), int(header.get("epoch", -1))
    del header
    out_dir = Path(cfg.paths.output_dir)
    print(f"[voxdiff] evaluating {ckpt_path} (step {step}) into {out_dir}", flush=True)
    result = _EVALUATIONS[kind](cfg, device, **({"subjects": subjects} if subjects is not None else {}),
                                **({"splits": splits} if splits is not None else {}))
    real = result.pop("real")
    run_dir = ckpt_path.parent.parent if ckpt_path.parent.name == "checkpoints" else ckpt_path.parent
    bootstrap = bootstrap_settings(cfg)
    series = read_loss_log(run_dir)
    if series:
        loss = ("Training loss", f"from {run_dir}/csv/*/metrics.csv", [(data_uri(loss_curve_png(series, step)),
                                                                        "loss per optimizer step")])
    else:
        loss = ("Training loss", f"absent: no CSV log under {run_dir}/csv/ (train with logger=csv or logger=wandb_csv "
                "to get one)", [])
    record = {
        "checkpoint": {"path": str(ckpt_path), "sha256": file_sha256(ckpt_path), "global_step": step,
                       "epoch": epoch, "kind": result["kind"], "mode": result["mode"],
                       "train_seed": result.get("train_seed")},  # a diffusion run's seed: recipes pair runs by it
        "evaluated_at": dt.datetime.now().isoformat(timespec="seconds"),
        "data": result["data"], "stage1_weights": result["stage1_weights"],
        "split": str(cfg.split), "n_generated": result["n_generated"], "n_real": len(real),
        "real_subjects": real.subjects, "volume_shape": list(real.images.shape[2:]),
        "sampling": result["sampling"],
        **({"reconstruction": result["reconstruction"]} if "reconstruction" in result else {}),
        "metric_settings": {**describe(MS_SSIM_PRESETS[cfg.ms_ssim]),  # bootstrap: the figures' intervals
                            "bootstrap": None if bootstrap is None else bootstrap.describe()},
        "feature_extractors": result["feature_extractors"], "figures": result["figures"], "absent": result["absent"],
        "seconds": result["seconds"],
    }
    title = f"voxdiff evaluation: {run_dir.name}, step {step}"
    meta = {"checkpoint": f"{ckpt_path} (step {step}, epoch {epoch})", "SHA-256": record["checkpoint"]["sha256"],
            "kind": f"{result['kind']} ({result['mode']})",
            "data": result["data"],
            "sets": f"{result['n_generated']} {'generated' if result['kind'] == 'diffusion' else 'reconstructed'}, "
                    f"{len(real)} real (split={cfg.split}), volumes {'×'.join(map(str, real.images.shape[2:]))}",
            "evaluated": record["evaluated_at"]}
    if result["sampling"]:
        s = result["sampling"]
        meta["sampling"] = f"{result['sampler'].describe()}, EMA {s['use_ema']}, seed {s['seed']}"
    page = render_html(title, meta, record["figures"], record["absent"], [*result["sections"], loss])
    json_path, html_path = write_outputs(out_dir, record, page)
    print(f"[voxdiff] wrote {json_path} and {html_path}", flush=True)
    for name, f in record["figures"].items():
        print(f"[voxdiff]   {name} = {f['value']:.6g}{interval_text(f)}", flush=True)
    _say_thin_tails([f["ci_tail_resamples"] for f in record["figures"].values() if "ci_tail_resamples" in f], cfg)
    return {**record, "json": str(json_path), "html": str(html_path), "resamplers": result.get("resamplers", {}),
            "resample_sizes": result.get("resample_sizes", {})}


@hydra_main("evaluate")
def main(cfg: DictConfig) -> None:
    """The ``voxdiff-evaluate`` / ``python evaluate.py`` entry point."""
    with refusals():
        validate(cfg)
        evaluate(cfg)


if __name__ == "__main__":
    main()
