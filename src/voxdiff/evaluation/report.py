"""The one-page report: a self-contained HTML file (every picture a base64 ``data:`` URI, no script, no server,
no network) beside ``metrics.json``.

Sections: the checkpoint and settings; the metric table (value, N, direction, definition); mask | real |
generated montages on the three mid-planes; intensity histograms of real against generated, inside and outside
the mask (a mask model: its lesions per mask and lesion sizes against the real masks'); the training loss curve
from the run's CSV log; what is absent and why.
"""

from __future__ import annotations

import base64
import csv
import html
import io
import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from voxdiff.evaluation.guidance_sweep import label_number, show
from voxdiff.files import atomic_write

#: ``direction`` values of a figure and how the table shows them
DIRECTIONS = {"higher": "↑ higher is better", "lower": "↓ lower is better",
              "match": "≈ closer to the real figure is better", "info": "—"}
#: the report's word on an interval widened for its sets' sizes (``uncertainty.Bootstrap.expand``)
EXPANDED_NOTE = ("; widened for the sets' sizes, as a t interval is wider than a normal one (the expanded percentile "
                 "bootstrap: a resample of few volumes spreads less than a new draw would)")


# ------------------------------------------------------------------------------------------------ pictures
def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)
    return fig


def png_bytes(fig: Any) -> bytes:
    """A matplotlib figure → PNG bytes. Every figure here is laid out by ``tight_layout`` first, so it is saved as
    it stands (``bbox_inches="tight"`` would draw it once more to crop a margin the layout already trimmed)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def _log_y(ax: Any) -> None:
    """A log y axis whose tick labels are plain numbers (``0.01``, ``2``, ``100``; minor ticks labelled where the
    axis spans few decades, as matplotlib's default does): the default writes them as mathtext (``10^{-2}``), whose
    parser costs about a third of a figure's time."""
    from matplotlib.ticker import LogFormatter

    class Plain(LogFormatter):  # LogFormatter decides which ticks are labelled; the label is the number as %g
        def __call__(self, x: float, pos: int | None = None) -> str:
            return f"{x:g}" if super().__call__(x, pos) else ""

    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(Plain())
    ax.yaxis.set_minor_formatter(Plain(labelOnlyBase=False))


def data_uri(png: bytes | str | os.PathLike[str]) -> str:
    """PNG bytes (or a PNG file) → a ``data:image/png;base64,...`` URI."""
    data = png if isinstance(png, bytes) else Path(png).read_bytes()
    return "data:image/png;base64," + base64.b64encode(data).decode("ascii")


def histogram_png(real: torch.Tensor, generated: torch.Tensor, masks_real: torch.Tensor,
                  masks_generated: torch.Tensor, bins: int = 64, label: str = "generated") -> bytes:
    """Intensity histograms (density) of real against generated voxels, inside and outside the masks.

    Args:
        real, generated: ``(N, 1, D, H, W)`` in [0, 1].
        masks_real, masks_generated: ``(N, 1, D, H, W)`` masks of each set.
    """
    fig = _figure(9.0, 3.2)
    edges = np.linspace(0.0, 1.0, bins + 1)
    for k, (title, inside) in enumerate((("inside the mask (lesion)", True), ("outside the mask", False))):
        ax = fig.add_subplot(1, 2, k + 1)
        for vols, masks, name, colour in ((real, masks_real, "real", "tab:blue"),
                                          (generated, masks_generated, label, "tab:orange")):
            region = masks > 0.5 if inside else masks <= 0.5
            values = vols.float()[region].clamp(0, 1).numpy()
            if values.size:
                ax.hist(values, bins=edges, density=True, histtype="step", linewidth=1.6, color=colour,
                        label=f"{name} ({values.size:,} voxels)")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("intensity (volume scaled to [0, 1])")
        _log_y(ax)
        ax.legend(fontsize=8)
    ax.figure.axes[0].set_ylabel("density (log)")
    fig.tight_layout()
    return png_bytes(fig)


#: lesions per mask shown one bar each up to this; masks with more share the last bar ("≥ N")
LESION_COUNT_BARS = 10


def _side_by_side(ax: Any, bars: Mapping[str, tuple[str, np.ndarray]], ticks: Sequence[str], xlabel: str,
                  ylabel: str, tick_size: float | None = None) -> None:
    """One bar per set at each tick, side by side: ``bars`` maps each legend label to its set's name (its colour)
    and its heights, one per tick."""
    colours = {"real": "tab:blue", "generated": "tab:orange"}
    width = 0.8 / max(1, len(bars))
    at = np.arange(len(ticks))
    for k, (label, (name, heights)) in enumerate(bars.items()):
        ax.bar(at + (k - (len(bars) - 1) / 2) * width, heights, width=width, color=colours.get(name), label=label)
    ax.set_xticks(at, list(ticks), fontsize=tick_size)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)


def lesion_distribution_png(counts: Mapping[str, Sequence[int]], sizes: Mapping[str, Mapping[str, Sequence[int]]]
                            ) -> bytes:
    """Two panels of a mask model's lesions, one bar per set side by side: the share of masks with 0, 1, ...,
    :data:`LESION_COUNT_BARS` or more lesions, and the share of lesions in each size band ``[2^k, 2^(k+1))`` voxels.

    Args:
        counts: each set's lesions per mask (``{"real": [...], "generated": [...]}``, the figures' ``per_mask``).
        sizes: each set's :func:`voxdiff.evaluation.lesions.size_histogram` (``edges``, ``lesions``).
    """
    fig = _figure(9.0, 3.2)
    per_count = {}
    for name, per_mask in counts.items():
        binned = np.bincount(np.minimum(np.asarray(per_mask, dtype=np.int64), LESION_COUNT_BARS),
                             minlength=LESION_COUNT_BARS + 1)
        per_count[f"{name} ({len(per_mask)} masks, {int(np.sum(per_mask))} lesions)"] = (
            name, binned / max(1, len(per_mask)))
    _side_by_side(fig.add_subplot(1, 2, 1), per_count, [*map(str, range(LESION_COUNT_BARS)), f"≥{LESION_COUNT_BARS}"],
                  "lesions per mask", "share of masks")
    bands = max(len(h["lesions"]) for h in sizes.values())
    per_band = {}
    for name, h in sizes.items():
        n = np.zeros(bands)
        n[: len(h["lesions"])] = h["lesions"]
        per_band[f"{name} ({int(n.sum())} lesions)"] = (name, n / max(1.0, n.sum()))
    _side_by_side(fig.add_subplot(1, 2, 2), per_band, [str(2**k) for k in range(bands)],
                  "voxels per lesion (from)", "share of lesions", tick_size=7)
    fig.tight_layout()
    return png_bytes(fig)


def read_loss_log(run_dir: str | os.PathLike[str]) -> dict[str, list[tuple[int, float]]]:
    """``{"train/loss": [(step, value), ...], "val/loss": [...]}`` from ``<run_dir>/csv/*/metrics.csv``.

    Lightning's CSV logger writes one ``metrics.csv`` per version; a resumed run adds a version that logs again the
    steps after its checkpoint. The files are read oldest first and a later file's value for a step replaces the
    earlier one, so the curve is the one the run followed. Rows without a value are skipped.
    """
    series: dict[str, dict[int, float]] = {}
    files = sorted(Path(run_dir).glob("csv/*/metrics.csv"), key=lambda p: (p.stat().st_mtime, str(p)))
    for path in files:
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                for key in ("train/loss", "val/loss"):
                    value = row.get(key) or ""
                    if value.strip() and (row.get("step") or "").strip():
                        series.setdefault(key, {})[int(float(row["step"]))] = float(value)
    return {k: sorted(v.items()) for k, v in series.items()}


def loss_curve_png(series: Mapping[str, Sequence[tuple[int, float]]], step: int | None = None) -> bytes:
    """The training curve: train loss (raw and a running mean over 10 points), validation loss, checkpoint step."""
    fig = _figure(9.0, 3.2)
    ax = fig.add_subplot(1, 1, 1)
    if "train/loss" in series:
        steps, values = zip(*series["train/loss"])
        ax.plot(steps, values, color="tab:blue", alpha=0.3, linewidth=0.8, label="train loss")
        k = min(10, len(values))
        smooth = np.convolve(values, np.ones(k) / k, mode="valid")
        ax.plot(steps[k - 1 :], smooth, color="tab:blue", linewidth=1.6, label=f"train loss (mean of {k})")
    if "val/loss" in series:
        steps, values = zip(*series["val/loss"])
        ax.plot(steps, values, "o-", color="tab:red", markersize=3, label="validation loss")
    if step is not None:
        ax.axvline(step, color="grey", linestyle="--", linewidth=1, label=f"checkpoint (step {step})")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    _log_y(ax)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return png_bytes(fig)


def scatter_png(series: Mapping[str, tuple[Sequence[float], Sequence[float]]], xlabel: str, ylabel: str,
                groups: Mapping[str, Sequence[Any]] | None = None) -> bytes:
    """One scatter of several labelled ``(x, y)`` series (e.g. generated ventricle size against requested age, for
    the model and its negative control). ``groups``: for a series' label, each point's group (counterfactuals: its
    mask), whose points are joined by a thin line in the series' colour, in the order of x."""
    fig = _figure(5.5, 3.6)
    ax = fig.add_subplot(1, 1, 1)
    for (label, (x, y)), marker in zip(series.items(), "os^D", strict=False):
        (points,) = ax.plot(x, y, marker, linestyle="none", alpha=0.8, label=label)
        of = (groups or {}).get(label)
        for g in dict.fromkeys(of or ()):
            line = sorted((u, v) for u, v, h in zip(x, y, of, strict=True) if h == g)
            ax.plot(*zip(*line, strict=True), "-", color=points.get_color(), alpha=0.35, linewidth=0.8)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return png_bytes(fig)


def sweep_png(summary: Mapping[str, Any]) -> bytes:
    """A guidance sweep (:func:`voxdiff.evaluation.guidance_sweep.summarise`): each ranked figure against the scale,
    a small panel each, its target dashed where it has one and the scale it prefers dotted. Compared checkpoints,
    recipes or intervals stand at evenly spaced places named by their number (``k`` of a label ``"k: ..."``, the
    table's column) or their interval; a recipe's runs (a value's, swept over one recipe's runs) are grey dots beside
    its mean."""
    ranked = {n: f for n, f in summary["figures"].items() if f["best"] is not None}
    values = list(summary["values"])
    numeric = all(isinstance(v, (int, float)) for v in values)
    xs = values if numeric else list(range(len(values)))
    shift = 0.12 * (min(b - a for a, b in zip(sorted(xs), sorted(xs)[1:])) if numeric and len(xs) > 1 else 1)
    names = None if numeric else [label_number(v) for v in values]
    cols = min(4, max(1, len(ranked)))
    rows = max(1, math.ceil(len(ranked) / cols))
    fig = _figure(3.0 * cols, 2.4 * rows)
    for k, (name, f) in enumerate(ranked.items()):
        ax = fig.add_subplot(rows, cols, k + 1)
        ax.errorbar(xs, f["values"], yerr=f.get("se"), fmt="o-", color="tab:orange", markersize=4, capsize=2)
        for x, each in zip(xs, f.get("runs", ())):  # recipes: each run's value beside the mean
            ax.plot([x - shift] * len(each), each, ".", color="grey", markersize=3)
        if f["target"] is not None:
            ax.axhline(f["target"], color="tab:blue", linestyle="--", linewidth=1)
        ax.axvline(xs[values.index(f["best"])], color="grey", linestyle=":", linewidth=1)
        ax.set_title(name, fontsize=8)
        ax.set_xlabel(summary["swept"] if summary["swept"] != "ckpt_path" else "recipe" if "runs" in f else
                      "checkpoint", fontsize=8)
        ax.tick_params(labelsize=7)
        if names is not None:
            ax.set_xticks(xs, names)
            ax.set_xlim(-0.5, len(xs) - 0.5)
    fig.tight_layout()
    return png_bytes(fig)


# ------------------------------------------------------------------------------------------------ HTML
def _fmt(value: Any) -> str:
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        return f"{value:.4g}" if abs(value) >= 1e-3 or value == 0 else f"{value:.3e}"
    return html.escape(str(value))


def interval_text(f: Mapping[str, Any]) -> str:
    """A figure's bootstrap interval as text, ``" [low, high]"`` (:mod:`voxdiff.evaluation.uncertainty`), or ``""``
    where it has none."""
    return f" [{_fmt(f['ci'][0])}, {_fmt(f['ci'][1])}]" if "ci" in f else ""


_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px auto;max-width:1100px;color:#222}
h1{font-size:22px;margin-bottom:4px} h2{font-size:17px;margin-top:28px;border-bottom:1px solid #ddd}
table{border-collapse:collapse;width:100%;font-size:13px} td,th{border:1px solid #ccc;padding:4px 6px;
vertical-align:top} th{background:#f2f2f2;text-align:left} td.num{text-align:right;white-space:nowrap;
font-variant-numeric:tabular-nums} .meta{font-size:13px;color:#444} .note{font-size:12px;color:#666}
img{max-width:100%;height:auto;display:block;margin:6px 0} figure{margin:0}
.montages{display:grid;grid-template-columns:repeat(auto-fill,minmax(340px,1fr));gap:8px} figcaption{font-size:12px;color:#555} code{font-size:12px}
"""


def _page_head(title: str, meta: Mapping[str, Any]) -> list[str]:
    """The start of a report page: the document head with the style, the heading and the ``{label: value}`` lines
    under it."""
    meta_rows = "".join(f"<div><b>{html.escape(k)}:</b> {html.escape(str(v))}</div>" for k, v in meta.items())
    return ["<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
            f"<title>{html.escape(title)}</title><style>{_CSS}</style></head><body>",
            f"<h1>{html.escape(title)}</h1><div class='meta'>{meta_rows}</div>"]


def render_html(title: str, meta: Mapping[str, Any], figures: Mapping[str, Mapping[str, Any]],
                absent: Mapping[str, str], sections: Sequence[tuple[str, str, Sequence[tuple[str, str]]]]) -> str:
    """The report page.

    Args:
        title: the page heading.
        meta: ``{label: value}`` lines under the heading (checkpoint, step, SHA-256, settings).
        figures: ``{name: {"value", "n", "direction", "definition", "label", ...}}`` as in ``metrics.json``.
        absent: ``{name: reason}`` for figures that were not computed.
        sections: ``(heading, note, [(data URI, caption), ...])`` picture sections, in order.
    """
    rows = []
    for name, f in figures.items():
        n = f.get("n", f.get("n_generated", ""))
        if "pairs" in f:
            n = f"{n} ({f['pairs']} of {f['all_pairs']} pairs, drawn at random)" if f.get("sampled") else \
                f"{n} ({f['pairs']} pairs)"
        elif "n_real" in f:
            n = f"{f['n_generated']} gen / {f['n_real']} real"
        value = _fmt(f["value"]) + (f" ± {_fmt(f['std'])}" if "std" in f else
                                    f" ± {_fmt(f['se'])} (se)" if "se" in f else "")
        ci = f"{interval_text(f).strip()} ({f['ci_level']:.0%})" if "ci" in f else ""
        if "ratio_to_real" in f:
            value += f"; {_fmt(f['ratio_to_real'])}× real"
        rows.append(f"<tr><td>{html.escape(f.get('label', name))}<br><code>{html.escape(name)}</code></td>"
                    f"<td class='num'>{value}</td><td class='num'>{ci}</td><td class='num'>{html.escape(str(n))}</td>"
                    f"<td>{html.escape(DIRECTIONS[f.get('direction', 'info')])}</td>"
                    f"<td>{html.escape(f.get('definition', ''))}</td></tr>")
    absent_rows = "".join(f"<li><code>{html.escape(k)}</code>: {html.escape(v)}</li>" for k, v in absent.items())
    parts = [
        *_page_head(title, meta),
        "<h2>Metrics</h2><table id='metrics'><thead><tr><th>figure</th><th>value (± std over samples, or ± standard "
        "error)</th><th>interval (bootstrap over volumes)</th><th>N</th><th>direction</th><th>definition</th></tr>"
        "</thead><tbody>", *rows, "</tbody></table>",
        "<p class='note'>Interval: where the volumes drawn alone could move the figure (each set resampled with "
        "replacement, the figure recomputed; settings in metrics.json, metric_settings.bootstrap)"
        f"{EXPANDED_NOTE if any('ci_expanded_by' in f for f in figures.values()) else ''}. Two evaluations "
        "whose intervals overlap widely cannot be told apart on these volumes.</p>" if any("ci" in f for f in
                                                                                              figures.values()) else "",
    ]
    if absent_rows:
        parts.append(f"<p class='note'><b>Not computed:</b></p><ul class='note'>{absent_rows}</ul>")
    for heading, note, images in sections:
        parts.append(f"<h2>{html.escape(heading)}</h2>")
        if note:
            parts.append(f"<p class='note'>{html.escape(note)}</p>")
        if images:
            figs = "".join(f"<figure><img src='{uri}' alt='{html.escape(cap)}'><figcaption>{html.escape(cap)}"
                           "</figcaption></figure>" for uri, cap in images)
            parts.append(f"<div class='{'montages' if len(images) > 1 else 'wide'}'>{figs}</div>")
    parts.append("</body></html>")
    return "\n".join(parts)


def render_sweep_html(title: str, meta: Mapping[str, Any], summary: Mapping[str, Any],
                      reports: Sequence[str], png: bytes) -> str:
    """The page of a guidance sweep: a row per figure with its value at each scale (± its standard error where it
    has one; the scale it prefers in bold, and those the evaluations cannot tell apart from it: ``tied``), its
    direction and target; the ranked figures plotted against the scale; each scale's own report linked
    (``reports``: paths relative to the page, one per scale; a comparison of recipes: a list of its runs' reports
    per recipe (per value, swept over one recipe's runs), and each run's value under the recipe's, ``runs``)."""
    key, values = summary["swept"], summary["values"]

    def header(value: Any, report: str | Sequence[str]) -> str:
        if isinstance(report, str):
            return f"<th><a href='{html.escape(report)}'>{html.escape(key)}={html.escape(show(value))}</a></th>"
        links = " ".join(f"<a href='{html.escape(r)}'>{k + 1}</a>" for k, r in enumerate(report))
        name = show(value) if key == "ckpt_path" else f"{key}={show(value)}"  # a recipe, or a value swept over one
        return f"<th>{html.escape(name)}<br><span class='note'>runs: {links}</span></th>"

    head = "".join(header(v, r) for v, r in zip(values, reports))
    rows = []
    for name, f in summary["figures"].items():
        shown = [_fmt(v) + (f" ± {_fmt(e)}" if e is not None else "")
                 for v, e in zip(f["values"], f.get("se") or [None] * len(values))]
        if "runs" in f:  # a recipe's figure is its runs' mean: each run's value under it
            shown = [f"{text}<br><span class='note'>{', '.join(_fmt(x) for x in each)}</span>"
                     for text, each in zip(shown, f["runs"])]
        bold = {f["best"], *f.get("tied", ())} - {None}
        cells = "".join(f"<td class='num'><b>{text}</b></td>" if scale in bold
                        else f"<td class='num'>{text}</td>" for scale, text in zip(values, shown))
        goal = "" if f["target"] is None else _fmt(f["target"])
        rows.append(f"<tr><td>{html.escape(str(f['label']))}<br><code>{html.escape(name)}</code></td>{cells}"
                    f"<td class='num'>{goal}</td><td>{html.escape(DIRECTIONS[f['direction']])}</td></tr>")
    return "\n".join([
        *_page_head(title, meta),
        "<h2>Figures at each scale</h2><p class='note'>Bold: the scale a figure prefers (its direction; a figure "
        "that should match the real set: the closest to its target), and every scale the evaluations cannot tell "
        "apart from it: where the figure has an interval, those whose paired bootstrap interval of the difference "
        "holds 0 (each resample draws the same masks, noise and real volumes at every scale; recipes: their runs "
        "resampled too); else, where it has a standard error, those within one standard error. The negative "
        "control's and the real set's "
        "figures are shown, not ranked. No scale is chosen for you: the figures disagree.</p>",
        f"<table id='metrics'><thead><tr><th>figure</th>{head}<th>target</th><th>direction</th></tr></thead><tbody>",
        *rows, "</tbody></table>",
        "<h2>Against the scale</h2>",
        f"<div class='wide'><figure><img src='{data_uri(png)}' alt='figures against {html.escape(key)}'>"
        f"<figcaption>each ranked figure against {html.escape(key)}; dashed: its target; dotted: the scale it "
        "prefers</figcaption></figure></div>",
        "</body></html>"])


def write_outputs(out_dir: str | os.PathLike[str], record: Mapping[str, Any], page: str,
                  names: tuple[str, str] = ("metrics.json", "report.html")) -> tuple[Path, Path]:
    """Write ``record`` as JSON and ``page`` into ``out_dir`` (created) as ``names`` (``metrics.json`` and
    ``report.html``), each atomically (:func:`voxdiff.files.atomic_write`: a failed write leaves the previous file
    and says why and where); returns both paths."""
    out = Path(out_dir)
    json_path, html_path = out / names[0], out / names[1]
    text = json.dumps(record, indent=2, allow_nan=True) + "\n"
    atomic_write(json_path, lambda f: f.write(text.encode("utf-8")))
    atomic_write(html_path, lambda f: f.write(page.encode("utf-8")))
    return json_path, html_path
