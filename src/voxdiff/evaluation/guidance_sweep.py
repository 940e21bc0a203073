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


def summarise(key: str, values: Sequence[float], records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The sweep's table: for each figure every evaluation has, its value at each of ``values`` (the ``key``'s
    scales, in the order run; ``se``: its standard error at each, where every evaluation gives one), its direction
    and target, and the scale it prefers (``best``; None where it is not ranked, or where its values are not
    finite). The preference reads the values alone: where two scales lie within their standard errors of each
    other, so does the choice.

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
        if all("se" in r["figures"][name] for r in records):  # an effect's standard error, at each scale
            figures[name]["se"] = [float(r["figures"][name]["se"]) for r in records]
    return {"swept": key, "values": list(values), "figures": figures}
