"""A guidance-scale sweep (or a comparison of checkpoints) read as one: every figure of the evaluations at each
scale side by side, and the scale each figure prefers.

``evaluate.py 'autoguide_scale=[1,1.1,1.25]'`` (or ``guidance_scale=[...]``) evaluates the checkpoint at each scale
with the same masks, noise and covariates (:mod:`voxdiff.cli.evaluate`; ``'ckpt_path=[a.ckpt,b.ckpt]'`` each
checkpoint, and a checkpoint takes the place of a scale below); :func:`summarise` puts their
``metrics.json`` records together. A figure is ranked where its direction says what is better
(:data:`voxdiff.evaluation.pipeline.DEFINITIONS`): ``higher``, ``lower``, or ``match`` (closest to its target: the
real set's twin figure, ``<name>_real`` for ``<name>_generated``, or 1 for a ratio to the real set). The negative
control's figures and the real set's own are shown, not ranked: they say whether a figure can be trusted, not which
scale samples better. No single scale is chosen: the figures disagree (on the demo autoguidance brings the ventricles
and the tissue mix toward the data while it lowers the paired SSIM and PSNR and sharpens past the data), and which
to trade is the user's. Which scales the evaluations cannot tell apart is said per figure (``tied``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from voxdiff.evaluation import uncertainty as U

#: the figures shown but not ranked: the negative control's (a diagnostic of the figure) and the real set's own
UNRANKED = ("_control", "_real")
#: how evaluations without a paired bootstrap are told apart: within one standard error
SE_RULE = "one standard error"


def show(value: Any) -> str:
    """A swept value as the page and the command print it: a scale as ``1.25``, a compared checkpoint's label as
    it is."""
    return f"{value:g}" if isinstance(value, (int, float)) else str(value)


def label_number(label: Any) -> str:
    """What a compared checkpoint's or recipe's label ``"<k>: ..."`` is called for short (the table's column,
    the plot's tick): ``k``."""
    return str(label).split(": ", 1)[0]


def train_seeds(records: Sequence[Mapping[str, Any]]) -> list[Any]:
    """The training seed of each evaluated checkpoint (``checkpoint.train_seed``; None where not recorded)."""
    return [(r.get("checkpoint") or {}).get("train_seed") for r in records]


def paired(records: Sequence[Mapping[str, Any]]) -> bool:
    """Whether the evaluations drew sample ``i`` from the same mask (``sampling.conditioned_on``) and the same real
    volumes (``real_subjects``): a sweep's always, a comparison's where the checkpoints split their data alike."""
    first = records[0]
    return all(r.get("real_subjects") == first.get("real_subjects") and r.get("n_generated") == first.get(
        "n_generated") and (r.get("sampling") or {}).get("conditioned_on") == (first.get("sampling") or {}).get(
        "conditioned_on") for r in records)


def twin(name: str) -> str | None:
    """The real set's figure a ``<stem>_generated`` figure should match (``<stem>_real``), else None."""
    return name[: -len("_generated")] + "_real" if name.endswith("_generated") else None


def target(name: str, figures: Mapping[str, Mapping[str, Any]]) -> float | None:
    """What a ``match`` figure should come close to: its real twin's value (``<stem>_real`` for
    ``<stem>_generated``), or 1 for a figure of generated over real, which carries both sets' figures
    (``anatomy_sharpness``); None where there is none."""
    if twin(name) is not None:
        real = figures.get(twin(name))
        return None if real is None else float(real["value"])
    if isinstance(figures[name].get("generated"), Mapping) and isinstance(figures[name].get("real"), Mapping):
        return 1.0
    return None


def _score(direction: str, goal: float | None):
    """How a figure of ``direction`` is ranked, lower better: its value (``lower``), its negative (``higher``), or
    its distance to ``goal`` (``match``)."""
    return {"higher": lambda v: -v, "lower": lambda v: v, "match": lambda v: abs(v - goal)}[direction]


def _sizes(record: Mapping[str, Any]) -> dict[str, int]:
    """The sets an evaluation's resamplers draw from and their sizes: its ``resample_sizes``, else ``n_generated``
    and ``n_real``."""
    return dict(record.get("resample_sizes") or {"generated": int(record["n_generated"]),
                                                 "real": int(record["n_real"])})


def _standard_error(values: Sequence[float]) -> float:
    """The standard error of the mean of ``values`` (at least 2): their sample standard deviation over √N."""
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1) / len(values))


def _ranked(name: str, direction: str) -> bool:
    return direction in ("higher", "lower", "match") and not any(part in name for part in UNRANKED)


def tied(values: Sequence[float], series: Sequence[float], se: Sequence[float], best: int, direction: str,
         goal: float | None) -> list[float]:
    """The scales other than ``values[best]`` whose figure lies within one standard error of the preferred one's, in
    the figure's own terms: for ``higher`` and ``lower`` its value, for ``match`` its distance to ``goal``; one
    standard error of the difference, ``sqrt(se_i**2 + se_best**2)`` (the two evaluations' errors taken as
    independent; a match figure's target is the same for both, so its own error is left out)."""
    at = (lambda v: abs(v - goal)) if direction == "match" else (lambda v: v)  # noqa: E731
    return [values[i] for i in range(len(values)) if i != best and math.isfinite(se[i])
            and abs(at(series[i]) - at(series[best])) <= math.hypot(se[i], se[best])]


def paired_ties(name: str, values: Sequence[Any], records: Sequence[Mapping[str, Any]], best: int, direction: str,
                goal: float | None, bootstrap: U.Bootstrap) -> tuple[list[Any], dict[str, list[float]]] | None:
    """The scales the evaluations cannot tell apart from ``values[best]`` on the figure ``name``, by a paired
    bootstrap: every evaluation of a sweep draws sample ``i`` from the same mask and noise, so each resample draws
    the same samples (and the same real volumes) at every scale, and the interval of the difference in the figure's
    score (:func:`voxdiff.evaluation.uncertainty.paired_interval`; ``match``: the distance to the real twin figure
    drawn on the same resample, or to ``goal``) holds 0 for a tied scale. Much tighter than comparing two intervals:
    what the scales share (the masks, the noise, the real set) cancels. The sets and their sizes are the records'
    ``resample_sizes`` (else ``n_generated`` and ``n_real``).

    Returns:
        ``(tied, differences)`` (``differences``: ``{scale: [low, high]}`` of score(scale) − score(best), lower
        score better), or None where the evaluations drew other masks or real volumes (:func:`paired`), an
        evaluation has no resampler for the figure, or a set is too small for an interval.
    """
    if not paired(records):
        return None
    resamplers = [r.get("resamplers", {}).get(name) for r in records]
    target = twin(name) if direction == "match" else None
    goal_resampler = records[best].get("resamplers", {}).get(target) if target else None
    if any(r is None for r in resamplers) or (target is not None and goal_resampler is None):
        return None
    sizes = _sizes(records[0])

    def score(v: torch.Tensor, t: torch.Tensor | None) -> torch.Tensor:
        if direction == "match":
            return (v - (t if t is not None else goal)).abs()
        return -v if direction == "higher" else v

    differences = {}
    for i, value in enumerate(values):
        if i != best:
            d = U.paired_interval(resamplers[i], resamplers[best], sizes, bootstrap, score, goal_resampler)
            if not d:
                return None
            differences[show(value)] = d["ci"]
    return [v for v in values if show(v) in differences and differences[show(v)][0] <= 0], differences


def summarise(key: str, values: Sequence[Any], records: Sequence[Mapping[str, Any]],
              bootstrap: U.Bootstrap | None = None) -> dict[str, Any]:
    """The sweep's table: for each figure every evaluation has, its value at each of ``values`` (the ``key``'s
    scales, in the order run; ``se``: its standard error at each, where every evaluation gives one: an effect's over
    masks, or the bootstrap's over volumes, :mod:`voxdiff.evaluation.uncertainty`), its direction
    and target, and the scale it prefers (``best``; None where it is not ranked, or where its values are not
    finite). ``tied`` lists the other scales the evaluations cannot tell apart from the preferred one, and the page
    and the command's summary say so: with ``bootstrap`` and each evaluation's resamplers (``records[i]
    ["resamplers"]``, from :func:`voxdiff.cli.evaluate.evaluate`), by a paired bootstrap (:func:`paired_ties`:
    ``tie_rule`` "paired bootstrap", ``differences`` its intervals; only where every evaluation drew the same masks
    and real volumes, :func:`paired`); else where the figure has standard errors,
    those within one standard error (:func:`tied`; ``tie_rule`` "one standard error"). A figure with neither has no
    ``tied``: its preference reads the values alone.

    Args:
        key: ``guidance_scale``, ``autoguide_scale`` or ``ckpt_path`` (a comparison).
        values: the scales (a comparison: each checkpoint's label), one per record.
        bootstrap: the intervals' settings of the evaluations (None: no paired ties).
        records: each evaluation's ``metrics.json`` record (``figures``: ``{name: {"value", "direction",
            "label", ...}}``).
    """
    if len(values) != len(records) or not records:
        raise ValueError(f"{len(values)} scales for {len(records)} evaluations")
    names = [n for n in records[0]["figures"] if all(n in r["figures"] for r in records)]
    figures: dict[str, Any] = {}
    for name in names:
        first = records[0]["figures"][name]
        series = [float(r["figures"][name]["value"]) for r in records]
        direction = str(first.get("direction", "info"))
        goal = target(name, records[0]["figures"]) if direction == "match" else None
        best = None
        if _ranked(name, direction) and all(math.isfinite(v) for v in series) and (direction != "match"
                                                                                    or goal is not None):
            score = _score(direction, goal)
            best = values[min(range(len(series)), key=lambda i: score(series[i]))]
        figures[name] = {"label": first.get("label", name), "direction": direction, "values": series,
                         "target": goal, "best": best}
        if all("se" in r["figures"][name] for r in records):  # a standard error at each: an effect's, a bootstrap's
            figures[name]["se"] = [float(r["figures"][name]["se"]) for r in records]
        if all("ci" in r["figures"][name] for r in records):
            figures[name]["ci"] = [[float(b) for b in r["figures"][name]["ci"]] for r in records]
            figures[name]["ci_tail_resamples"] = [r["figures"][name].get("ci_tail_resamples") for r in records]
        ties = None if best is None or bootstrap is None else paired_ties(
            name, values, records, values.index(best), direction, goal, bootstrap)
        if ties is not None:
            figures[name].update(tied=ties[0], differences=ties[1], tie_rule="paired bootstrap")
        elif best is not None and "se" in figures[name]:
            figures[name].update(tied=tied(values, series, figures[name]["se"], values.index(best), direction, goal),
                                 tie_rule=SE_RULE)
    return {"swept": key, "values": list(values), "figures": figures}


#: how recipes are told apart with fewer than :data:`voxdiff.evaluation.uncertainty.MIN_VOLUMES` runs each
RUNS_RULE = "one standard error over runs"
#: the same, where the runs are paired by seed: the standard error of the per-seed differences
SEEDS_RULE = "one standard error of the per-seed differences"
#: the same, where every value of a sweep was sampled by the same runs: the per-run differences
RUN_PAIRS_RULE = "one standard error of the per-run differences"


def seed_ties(runs: Sequence[Sequence[float]], best: int, direction: str, goal: float | None) -> list[int]:
    """The recipes (indices) whose runs, paired by seed with those of recipe ``best`` (run ``k`` of each), score
    within one standard error of the per-seed differences of it: the mean of ``score(run k) − score(best's run k)``
    at most its standard error (``score``: the figure's value, its negative for ``higher``, its distance to ``goal``
    for ``match``; lower is better)."""
    score = _score(direction, goal)
    out = []
    for g, each in enumerate(runs):
        if g != best:
            d = [score(x) - score(y) for x, y in zip(each, runs[best], strict=True)]
            if sum(d) / len(d) <= _standard_error(d):
                out.append(g)
    return out


def seed_order(groups: Sequence[Sequence[Mapping[str, Any]]]) -> list[list[int]] | None:
    """How to list each recipe's runs (``groups``: per recipe, its runs' evaluations) in the first recipe's seed
    order (``checkpoint.train_seed``): per recipe, the index of its run of each of the first recipe's seeds in turn;
    None where the recipes do not each hold one run of every seed of the first (a seed missing, repeated or not
    recorded): their runs cannot be paired by seed."""
    seeds = [train_seeds(g) for g in groups]
    first = seeds[0]
    if None in first or len(set(first)) != len(first) or any(sorted(s) != sorted(first) for s in seeds):
        return None
    return [[each.index(seed) for seed in first] for each in seeds]


def recipes(labels: Sequence[Any], groups: Sequence[Sequence[Mapping[str, Any]]],
            bootstrap: U.Bootstrap | None = None, swept: str | None = None) -> dict[str, Any]:
    """A comparison of training recipes, each trained several times (``groups``: per recipe, its runs'
    evaluations, all drawn from the same masks, noise and real volumes): :func:`summarise` of the recipes, where a
    recipe's figure is the mean of its runs' (``runs``: each run's value) and its interval and ties are over both
    the training runs and the volumes, by a bootstrap of both
    (:func:`voxdiff.evaluation.uncertainty.runs_of`: each recipe's runs resampled apart, the volumes shared).
    Where every recipe lists runs of the same training seeds in the same order (``checkpoint.train_seed`` of each
    record), run ``k`` of each recipe started from the same initial weights and the same first epoch of batches
    (a recipe that draws more random numbers parts from the others' noise), so the runs are paired as the volumes
    are: a resample draws the same seeds for every recipe, and what a seed
    does to every recipe alike cancels (``runs_paired_by_seed``).
    With fewer than :data:`~voxdiff.evaluation.uncertainty.MIN_VOLUMES` runs in a recipe that bootstrap cannot
    draw the runs' spread (a resample of 3 runs repeats one most of the time): then ``se`` is the standard error
    of the mean over the runs (their spread on these masks: the volumes' own spread is left out) and the ties are
    within one of it (``tie_rule`` :data:`RUNS_RULE`), as with evaluations drawn from other masks; so too for a
    figure that has no resampler (a Fréchet distance).

    Runs paired by seed but too few to resample are tied by the per-seed differences instead (:func:`seed_ties`,
    ``tie_rule`` :data:`SEEDS_RULE`).

    ``swept``: a guidance setting swept over one recipe's runs (``labels`` its values, ``groups`` the same runs
    sampled at each): the runs are paired run by run whatever their seeds (``same_runs`` in the record; the ties of
    few runs by the per-run differences, :data:`RUN_PAIRS_RULE`); None: recipes compared (``ckpt_path``).

    Returns:
        :func:`summarise`'s table plus ``runs`` (runs per recipe), ``runs_paired_by_seed``, ``same_runs``,
        ``intervals_over`` (what the intervals and ties are over), and per figure ``runs`` (``[[value of each run]
        per recipe]``).
    """
    if len(labels) != len(groups) or any(len(g) < 2 for g in groups):
        raise ValueError(f"recipes: {len(labels)} labels for {len(groups)} recipes, each of at least 2 runs")
    every = [r for g in groups for r in g]
    first = every[0]
    crossed = bootstrap is not None and paired(every) and min(len(g) for g in groups) >= U.MIN_VOLUMES
    sizes = _sizes(first)
    seeds = [train_seeds(g) for g in groups]
    by_seed = all(s == seeds[0] for s in seeds) and None not in seeds[0] and len(set(seeds[0])) == len(seeds[0])
    same_runs = swept is not None
    paired_runs = by_seed or same_runs
    run_sets = ["runs" if paired_runs else f"runs_{g + 1}" for g in range(len(groups))]  # one set: paired runs
    sizes.update({name: len(runs) for name, runs in zip(run_sets, groups)})
    virtual = []
    for g, runs in enumerate(groups):
        names = [n for n in runs[0]["figures"] if all(n in r["figures"] for r in runs)]
        figures, resamplers = {}, {}
        for name in names:
            one = runs[0]["figures"][name]
            values = [float(r["figures"][name]["value"]) for r in runs]
            f: dict[str, Any] = {"value": sum(values) / len(values), "runs": values, "label": one.get("label", name),
                                 "direction": one.get("direction", "info")}
            if isinstance(one.get("generated"), Mapping) and isinstance(one.get("real"), Mapping):
                f.update(generated=one["generated"], real=one["real"])  # a ratio to the real set: its target is 1
            members = [r.get("resamplers", {}).get(name) for r in runs]
            if crossed and all(m is not None for m in members):
                resamplers[name] = U.runs_of(members, run_sets[g])
                f.update(U.interval(resamplers[name], sizes, bootstrap))
            if "se" not in f and all(math.isfinite(v) for v in values):  # no resampler (a Fréchet distance), a set
                # too small for an interval, or few runs
                f["se"] = _standard_error(values)
            figures[name] = f
        virtual.append({**{k: runs[0].get(k) for k in ("real_subjects", "n_generated", "n_real", "sampling")},
                        "figures": figures, "resamplers": resamplers, "resample_sizes": sizes})
    summary = summarise(swept or "ckpt_path", list(labels), virtual, bootstrap if crossed else None)
    for name, f in summary["figures"].items():
        f["runs"] = [v["figures"][name]["runs"] for v in virtual]
        if f.get("tie_rule") == SE_RULE:
            f["tie_rule"] = RUNS_RULE
            if paired_runs:  # paired by seed (the same runs): the per-seed differences' spread, not the runs'
                f["tied"] = [labels[g] for g in seed_ties(f["runs"], list(labels).index(f["best"]), f["direction"],
                                                          f["target"])]
                f["tie_rule"] = RUN_PAIRS_RULE if same_runs else SEEDS_RULE
    pairing = "the same runs at every value" if same_runs else "runs paired by seed"
    over = (f"training runs and volumes (a bootstrap of both, crossed{'; ' + pairing if paired_runs else ''})"
            if crossed else
            f"training runs on these volumes (standard error of the mean over runs: fewer than {U.MIN_VOLUMES} runs "
            "a recipe, no bootstrap, or runs drawn from other masks"
            + ("; ties by the per-run differences, the same runs at every value" if same_runs else
               "; ties by the per-seed differences" if by_seed else "") + ")")
    return {**summary, "runs": [len(g) for g in groups], "runs_paired_by_seed": by_seed, "same_runs": same_runs,
            "intervals_over": over}
