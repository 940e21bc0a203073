"""A guidance-scale sweep read as one: every figure of the evaluations at each scale side by side, and the scale
each figure prefers.

``evaluate.py 'autoguide_scale=[1,1.1,1.25]'`` (or ``guidance_scale=[...]``) evaluates the checkpoint at each scale
with the same masks, noise and covariates (:mod:`voxdiff.cli.evaluate`); :func:`summarise` puts their
``metrics.json`` records together. A figure is ranked where its direction says what is better
(:data:`voxdiff.evaluation.pipeline.DEFINITIONS`): ``higher``, ``lower``, or ``match`` (closest to its target: the
real set's twin figure, ``<name>_real`` for ``<name>_generated``, or 1 for a ratio to the real set). The negative
control's figures and the real set's own are shown, not ranked: they say whether a figure can be trusted, not which
scale samples better. No single scale is chosen: the figures disagree (autoguidance raises the lesion contrast
and the covariate's effect while it moves the tissue mix away from the data), and which to trade is the user's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

#: the figures shown but not ranked: the negative control's (a diagnostic of the figure) and the real set's own
UNRANKED = ("_control", "_real")


def target(name: str, figures: Mapping[str, Mapping[str, Any]]) -> float | None:
    """What a ``match`` figure should come close to: its real twin's value (``<stem>_real`` for
    ``<stem>_generated``), or 1 for a figure of generated over real, which carries both sets' figures
    (``anatomy_sharpness``); None where there is none."""
    if name.endswith("_generated"):
        twin = figures.get(name[: -len("_generated")] + "_real")
        return None if twin is None else float(twin["value"])
    if isinstance(figures[name].get("generated"), Mapping) and isinstance(figures[name].get("real"), Mapping):
        return 1.0
    return None


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


def summarise(key: str, values: Sequence[float], records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The sweep's table: for each figure every evaluation has, its value at each of ``values`` (the ``key``'s
    scales, in the order run; ``se``: its standard error at each, where every evaluation gives one: an effect's over
    masks, or the bootstrap's over volumes, :mod:`voxdiff.evaluation.uncertainty`), its direction
    and target, and the scale it prefers (``best``; None where it is not ranked, or where its values are not
    finite). Where the figure has standard errors, ``tied`` lists the other scales within one standard error of the
    preferred one (:func:`tied`): the evaluation cannot tell them apart, and the page and the command's summary say
    so. A figure without standard errors has no ``tied``: its preference reads the values alone.

    Args:
        key: ``guidance_scale`` or ``autoguide_scale``.
        values: the scales, one per record.
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
            score = {"higher": lambda v: -v, "lower": lambda v: v, "match": lambda v: abs(v - goal)}[direction]
            best = values[min(range(len(series)), key=lambda i: score(series[i]))]
        figures[name] = {"label": first.get("label", name), "direction": direction, "values": series,
                         "target": goal, "best": best}
        if all("se" in r["figures"][name] for r in records):  # a standard error at each: an effect's, a bootstrap's
            figures[name]["se"] = [float(r["figures"][name]["se"]) for r in records]
            if best is not None:
                figures[name]["tied"] = tied(values, series, figures[name]["se"], values.index(best), direction, goal)
    return {"swept": key, "values": list(values), "figures": figures}
