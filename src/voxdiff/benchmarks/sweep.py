"""Predict the step memory of many UNet configurations from a CSV, and compare with measurements.

The CSV format is that of ``reference/measured_vram.csv``: one row per configuration with the columns
``input_shape`` (``C x D x H x W``, e.g. ``16x80x64x64``), ``in_channels``, ``out_channels``, ``channels``
(space-separated), ``attention_levels`` (0/1 per level, space-separated), ``num_res_blocks`` (space-separated),
``num_head_channels``, ``norm_num_groups``, ``grad_checkpointing`` (the UNet's columns are read by
:meth:`voxdiff.models.UNetSpec.from_row`) and, optionally, ``use_flash_attention``, ``batch_size``, ``recipe``,
``gpu`` (the GPU the row was measured on, as torch names it: its budget, cuBLAS workspaces and compute capability
are the row's; rows without one are predicted for the configured GPU) and the step variants of :func:`row_step`:
``compile`` (0/1: ``torch.compile(model)``), ``optimizer_impl`` (foreach/fused/single) and ``zero_grad_at``
(before_backward/after_step). An absent or empty column leaves the recipe's own choice. Every other column is
carried through unchanged. :func:`sweep` appends the
``pred_*`` columns of :data:`PRED_COLUMNS` (GiB = 2**30 bytes) and draws parameters vs predicted peak.

The training step traced for a row is named, never assumed: by the row's ``recipe`` column (``seed``: the step
of the reference measurements, :data:`voxdiff.step.SEED`; ``system``: ``train.py``'s step for the run config)
or, for rows without one, by the ``recipe`` argument (``preflight.recipe`` on the command line).

Models are built by voxdiff's own factory and gradient-checkpointing policy (:func:`build_monai_unet`,
:data:`MODEL_FACTORY`, or the ``build_model`` argument of :func:`sweep`), under ``torch.device("meta")``.
"""

from __future__ import annotations

import csv
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from torch import nn

from voxdiff.errors import ConfigError
from voxdiff.models import build_unet_from_spec
from voxdiff.models.unet import UNetSpec, row_flag
from voxdiff.preflight.memory import DEFAULT_SAFETY_MARGIN, MemoryReport, predict_step_memory
from voxdiff.run.gpus import DEFAULT_GPU, GpuSpec, gpu_type
from voxdiff.step import RECIPES, SEED, Recipe
from voxdiff.step.optim import OPTIMIZER_IMPLS
from voxdiff.step.recipe import ZERO_GRAD_AT
from voxdiff.units import GiB

__all__ = [
    "MODEL_FACTORY",
    "PRED_COLUMNS",
    "UNetRow",
    "build_monai_unet",
    "PhaseComparison",
    "compare_phases",
    "comparison_table",
    "parse_row",
    "plot_sweep",
    "predict_row",
    "read_sweep_csv",
    "row_gpu",
    "row_recipe",
    "row_step",
    "sweep",
]

PRED_COLUMNS: tuple[str, ...] = (
    "pred_params_m",
    "pred_fwd_gib",
    "pred_bwd_gib",
    "pred_opt_gib",
    "pred_step1_gib",
    "pred_steady_fwd_gib",
    "pred_steady_bwd_gib",
    "pred_steady_opt_gib",
    "pred_steady_gib",
    "pred_reserved_gib",
    "pred_fits",
    "pred_recipe",
    "pred_gpu",
    "pred_model_step",
    "pred_error",
)
"""Columns :func:`sweep` appends: parameters (millions); step-1 forward, backward and ``optimizer.step()`` peaks
and the peak over step 1; the same for a steady-state step; predicted reserved memory; the verdict against the
budget; the training-step recipe traced; the GPU predicted for (the row's ``gpu`` column, else the configured one);
how the model ran in it (``eager``, ``compiled`` or ``upper bound (eager)`` where the compiled prediction failed); why
the row could not be predicted (empty when it could)."""

#: the columns every sweep row needs (parse_row); every other column is carried through
REQUIRED_COLUMNS: tuple[str, ...] = ("input_shape", "in_channels", "out_channels", "channels", "attention_levels",
                                     "num_res_blocks", "num_head_channels", "norm_num_groups")
SWEEP_KEY = "preflight.sweep"

MEASURED_PHASES: dict[str, tuple[tuple[str, ...], str]] = {
    "step1 forward": (("s1_fwd",), "pred_fwd_gib"),
    "step1 backward": (("s1_bwd",), "pred_bwd_gib"),
    "step1 optimizer": (("s1_opt",), "pred_opt_gib"),
    "step1": (("step1_gib",), "pred_step1_gib"),
    "steady forward": (("s2_fwd", "s3_fwd"), "pred_steady_fwd_gib"),
    "steady backward": (("s2_bwd", "s3_bwd"), "pred_steady_bwd_gib"),
    "steady optimizer": (("s2_opt", "s3_opt"), "pred_steady_opt_gib"),
    "steady": (("steady_gib",), "pred_steady_gib"),
}
"""Phase -> (the columns of ``reference/h100_measured.csv`` whose largest value is the measurement, the prediction's
column). Steady state: steps 2 and 3, as ``steady_gib`` is their peak."""


@dataclass(frozen=True)
class UNetRow:
    """One sweep row: a MONAI ``DiffusionModelUNet(spatial_dims=3)`` and its input.

    Attributes:
        spec: the UNet (:meth:`voxdiff.models.UNetSpec.from_row`; ``grad_checkpointing=1`` is checkpointing per
            resnet/attention block, ``model.gradient_checkpointing=layer``).
        input_shape: ``(B, C_in, D, H, W)``.
    """

    spec: UNetSpec
    input_shape: tuple[int, ...]


def parse_row(row: Mapping[str, Any]) -> UNetRow:
    """Read and check one CSV row: the UNet's own rules (:meth:`UNetSpec.from_row`), then its input
    (:meth:`UNetSpec.check_input`). Raises ``ValueError`` (a :class:`ConfigError` is one) or ``KeyError``."""
    cdhw = tuple(int(v) for v in str(row["input_shape"]).lower().split("x"))
    if len(cdhw) != 4:
        raise ValueError(f"input_shape={row['input_shape']!r} must be CxDxHxW")
    batch = int(row.get("batch_size") or 1)  # an absent or empty column: batch 1, as the reference measured
    if batch < 1:
        raise ValueError(f"batch_size={row.get('batch_size')!r} must be 1 or more")
    spec = UNetSpec.from_row(row)
    spec.check_input((batch, *cdhw))
    return UNetRow(spec, (batch, *cdhw))


def build_monai_unet(cfg: UNetRow) -> nn.Module:
    """MONAI ``DiffusionModelUNet(spatial_dims=3, ...)`` for a row, through voxdiff's model factory and its
    gradient-checkpointing policy (``preserve_rng_state=False`` keeps the trace off the CUDA RNG — these blocks
    draw no random numbers)."""
    return build_unet_from_spec(cfg.spec, preserve_rng_state=False)


def row_gpu(row: Mapping[str, Any], gpu: GpuSpec | str | None = None) -> GpuSpec:
    """The GPU of a row: its ``gpu`` column (a type of :data:`~voxdiff.run.gpus.GPUS` or the name torch reports
    for one, as the reference CSVs record it) when set, else ``gpu``, else the default GPU.

    Raises:
        ConfigError: a GPU the table does not know.
    """
    named = str(row.get("gpu") or "").strip()
    if named:
        return gpu_type(named, key="gpu")
    if isinstance(gpu, GpuSpec):
        return gpu
    return gpu_type(gpu or DEFAULT_GPU)


MODEL_FACTORY: Callable[[UNetRow], nn.Module] = build_monai_unet
"""Row -> module (with its checkpointing policy applied)."""


def row_recipe(row: Mapping[str, Any], recipe: Recipe | None = None, system: Recipe | None = None) -> Recipe:
    """The recipe a row names in its ``recipe`` column, else ``recipe``.

    Args:
        row: the CSV row.
        recipe: the recipe of rows without a ``recipe`` column (or with an empty one).
        system: what ``recipe=system`` stands for (the run config's step); needed only by rows that name it.

    Raises:
        ValueError: no recipe named, or one that is not known.
    """
    name = str(row.get("recipe") or "").strip()
    if not name:
        if recipe is None:
            raise ValueError("the row names no training step: add a recipe column (seed or system) or name one "
                             "(preflight.recipe=seed for the reference measurements' step)")
        return recipe
    if name == "seed":
        return SEED
    if name == "system" and system is not None:
        return system
    if name == "system":
        raise ValueError("recipe=system needs the run config's step (pass system=recipe_from_config(cfg, 'system'))")
    raise ValueError(f"recipe={name!r} is not known; use one of {', '.join(RECIPES)}")


_OPTIMIZER_FLAGS = {"foreach": {"foreach": True, "fused": None}, "fused": {"foreach": None, "fused": True},
                    "single": {"foreach": False, "fused": None}}


def row_step(row: Mapping[str, Any], recipe: Recipe) -> tuple[Recipe, bool | None]:
    """The row's step variant: ``recipe`` with the row's ``optimizer_impl`` and ``zero_grad_at`` where given, and
    its ``compile`` flag (None where the row has none).

    Raises:
        ValueError: a value those columns do not take, naming the column and the values it takes.
    """
    impl = str(row.get("optimizer_impl") or "").strip()
    if impl:
        if impl not in OPTIMIZER_IMPLS:
            raise ValueError(f"optimizer_impl={impl!r}: use one of {', '.join(OPTIMIZER_IMPLS)}")
        recipe = replace(recipe, optim=replace(recipe.optim, **_OPTIMIZER_FLAGS[impl]))
    order = str(row.get("zero_grad_at") or "").strip()
    if order:
        if order not in ZERO_GRAD_AT:
            raise ValueError(f"zero_grad_at={order!r}: use one of {', '.join(ZERO_GRAD_AT)}")
        recipe = replace(recipe, zero_grad_at=order)
    flag = str(row.get("compile") or "").strip()
    try:
        compile_flag = row_flag(flag) if flag else None
    except ValueError:
        raise ValueError(f"compile={flag!r}: use 1 (torch.compile) or 0 (eager)") from None
    return recipe, compile_flag


def predict_row(
    row: Mapping[str, Any],
    recipe: Recipe | None = None,
    *,
    system: Recipe | None = None,
    build_model: Callable[[UNetRow], nn.Module] | None = None,
    budget_gib: float | None = None,
    gpu: GpuSpec | str | None = None,
    safety_margin: float = DEFAULT_SAFETY_MARGIN,
    **predict_kwargs: Any,
) -> tuple[dict[str, str], MemoryReport | None]:
    """Predict one CSV row; never raises for a bad row.

    Args:
        row: the CSV row.
        recipe, system: the training step traced (see :func:`row_recipe`).
        build_model: overrides :data:`MODEL_FACTORY`.
        budget_gib: device memory budget in GiB; None: the memory of the row's GPU.
        gpu: the GPU of a row without a ``gpu`` column (:func:`row_gpu`): its budget, workspaces and capability.
        safety_margin: see :meth:`MemoryReport.fits`.
        **predict_kwargs: forwarded to :func:`~voxdiff.preflight.memory.predict_step_memory`.

    Returns:
        The ``pred_*`` columns as strings, and the report (``None`` when ``pred_error`` is set).
    """
    out = dict.fromkeys(PRED_COLUMNS, "")
    try:
        cfg = parse_row(row)
        row_spec = row_gpu(row, gpu)
        factory = build_model or MODEL_FACTORY

        def build() -> nn.Module:
            return factory(cfg)

        step, compile_flag = row_step(row, row_recipe(row, recipe, system))
        kwargs = {"attention": "flash" if cfg.spec.use_flash_attention else "materialised", "gpu": row_spec,
                  **predict_kwargs}
        if compile_flag is not None:
            kwargs["compile"] = compile_flag
        report = predict_step_memory(build, cfg.input_shape, step, **kwargs)
    except Exception as exc:  # one bad row must not stop the sweep
        out["pred_error"] = f"{type(exc).__name__}: {exc}".replace("\n", " ")
        return out, None
    out.update(
        pred_params_m=f"{report.params / 1e6:.3f}",
        pred_fwd_gib=f"{report.first_step.forward / GiB:.3f}",
        pred_bwd_gib=f"{report.first_step.backward / GiB:.3f}",
        pred_opt_gib=f"{report.first_step.optimizer / GiB:.3f}",
        pred_step1_gib=f"{report.first_step.peak / GiB:.3f}",
        pred_steady_fwd_gib=f"{report.steady_step.forward / GiB:.3f}",
        pred_steady_bwd_gib=f"{report.steady_step.backward / GiB:.3f}",
        pred_steady_opt_gib=f"{report.steady_step.optimizer / GiB:.3f}",
        pred_steady_gib=f"{report.steady_step.peak / GiB:.3f}",
        pred_reserved_gib=f"{report.estimated_reserved / GiB:.3f}",
        pred_fits=str(report.fits(int((row_spec.total_gib if budget_gib is None else budget_gib) * GiB),
                                  safety_margin)).lower(),
        pred_gpu=row_spec.name,
        pred_recipe=report.recipe,
        pred_model_step=report.model_step,
    )
    return out, report


def sweep(
    in_csv: str | Path,
    out_csv: str | Path,
    recipe: Recipe | None = None,
    *,
    system: Recipe | None = None,
    build_model: Callable[[UNetRow], nn.Module] | None = None,
    budget_gib: float | None = None,
    gpu: GpuSpec | str | None = None,
    safety_margin: float = DEFAULT_SAFETY_MARGIN,
    plot_path: str | Path | None = "",
    **predict_kwargs: Any,
) -> list[dict[str, str]]:
    """Predict every row of ``in_csv`` and write ``out_csv`` (input columns + :data:`PRED_COLUMNS`).

    Args:
        in_csv: rows in the format of ``measured_vram.csv``.
        out_csv: where to write.
        recipe, system: the training step traced for each row (see :func:`row_recipe`).
        build_model: row -> module, overrides :data:`MODEL_FACTORY`.
        budget_gib: device memory budget in GiB; None: each row's GPU's memory (:func:`row_gpu`).
        gpu: the GPU of rows without a ``gpu`` column (default :data:`~voxdiff.run.gpus.DEFAULT_GPU`).
        safety_margin: fraction added to the predicted peak before comparing with the budget.
        plot_path: PNG of parameters vs predicted peak; ``""`` puts it next to ``out_csv`` with suffix
            ``.png``, ``None`` skips the plot.
        **predict_kwargs: forwarded to :func:`~voxdiff.preflight.memory.predict_step_memory` (precision, ...);
            bf16 AMP by default; the batch is the row's ``batch_size`` (1 when absent).

    Returns:
        The output rows.

    Raises:
        ConfigError: ``in_csv`` is not a sweep CSV (:func:`read_sweep_csv`), or it has no ``recipe`` column and
            no ``recipe`` is given (the step to trace is never assumed), before any row is traced.
    """
    fields, rows = read_sweep_csv(in_csv)
    if recipe is None and "recipe" not in fields:
        raise ConfigError("preflight.recipe", None, f"{in_csv} has no recipe column, so the training step to trace "
                          "must be named", "add preflight.recipe=seed (the step of the reference measurements) or "
                          "preflight.recipe=system (train.py's step for this config)")
    out_rows = []
    for row in rows:
        pred, _ = predict_row(row, recipe, system=system, build_model=build_model, budget_gib=budget_gib, gpu=gpu,
                              safety_margin=safety_margin, **predict_kwargs)
        out_rows.append({**row, **pred})
    out_fields = fields + [c for c in PRED_COLUMNS if c not in fields]
    with open(out_csv, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=out_fields)
        writer.writeheader()
        writer.writerows(out_rows)
    valid = [r for r in out_rows if not r["pred_error"]]
    if not valid:
        first = out_rows[0]
        raise ConfigError(SWEEP_KEY, str(in_csv), f"has no valid row: all {len(out_rows)} failed (row 1, "
                          f"{first.get('name') or 'unnamed'}: {first['pred_error']}; every row's error is in "
                          f"{out_csv}, column pred_error)", "fix the rows as the errors say")
    if plot_path is not None:
        plot_sweep(out_rows, plot_path or Path(out_csv).with_suffix(".png"),
                   budget_gib=row_gpu({}, gpu).total_gib if budget_gib is None else budget_gib)
    return out_rows


def read_sweep_csv(path: str | Path) -> tuple[list[str], list[dict[str, str]]]:
    """The header and the rows of a sweep CSV.

    Raises:
        ConfigError: not a UTF-8 text CSV, no rows, or a required column missing (named as ``preflight.sweep``).
    """
    fix = "give a CSV in the format of reference/measured_vram.csv (a header, then one configuration per row)"
    try:
        with open(path, newline="", encoding="utf-8") as fh:
            reader = csv.DictReader(fh)
            fields = list(reader.fieldnames or [])
            rows = list(reader)
    except (UnicodeDecodeError, csv.Error) as err:
        reason = "not UTF-8 text" if isinstance(err, UnicodeDecodeError) else str(err)
        raise ConfigError(SWEEP_KEY, str(path), f"is not a text CSV ({reason})", fix) from None
    missing = [c for c in REQUIRED_COLUMNS if c not in fields]
    if missing:
        raise ConfigError(SWEEP_KEY, str(path), f"lacks the column(s) {', '.join(missing)}" + (
            f" (its header: {', '.join(fields)})" if fields else " (it has no header)"), fix)
    if not rows:
        raise ConfigError(SWEEP_KEY, str(path), "has no configuration rows (only a header)", fix)
    return fields, rows


def _float(text: Any) -> float | None:
    try:
        return float(text)
    except (TypeError, ValueError):
        return None


def plot_sweep(rows: Sequence[Mapping[str, Any]], path: str | Path, budget_gib: float | None = None) -> Path:
    """Scatter parameters (M) against the predicted peak (GiB), measured ``total_gib`` where present.

    The predicted peak of a row is the larger of ``pred_step1_gib`` and ``pred_steady_gib``; the measured one the
    larger of ``step1_gib`` and ``steady_gib`` (``reference/h100_measured.csv``), else ``total_gib``
    (``measured_vram.csv``), drawn at the row's ``params_m`` (or the predicted count when absent).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5))
    px, py, mx, my = [], [], [], []
    for r in rows:
        p = _float(r.get("pred_params_m"))
        s1, s2 = _float(r.get("pred_step1_gib")), _float(r.get("pred_steady_gib"))
        if p is not None and s1 is not None and s2 is not None:
            px.append(p)
            py.append(max(s1, s2))
        measured = [v for v in (_float(r.get(k)) for k in ("step1_gib", "steady_gib")) if v is not None]
        m = max(measured) if measured else _float(r.get("total_gib"))
        mp = _float(r.get("params_m")) or p
        if m is not None and mp is not None:
            mx.append(mp)
            my.append(m)
    ax.scatter(px, py, marker="o", facecolors="none", edgecolors="C0", label="predicted peak (max of step 1, steady)")
    if mx:
        ax.scatter(mx, my, marker="x", color="C1", label="measured peak")
    if budget_gib is not None:
        ax.axhline(budget_gib, color="C3", linestyle="--", label=f"budget {budget_gib:g} GiB")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("parameters (M)")
    ax.set_ylabel("peak allocated (GiB, 2^30 B)")
    ax.set_title("voxdiff preflight: one training step, batch 1")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


@dataclass(frozen=True)
class PhaseComparison:
    """Predicted vs measured peak of one phase of one row of ``reference/h100_measured.csv`` (GiB).

    Attributes:
        name: row name.
        table: the row's ``table``.
        phase: a key of :data:`MEASURED_PHASES`.
        measured: the measured peak.
        predicted: the predicted peak.
    """

    name: str
    table: str
    phase: str
    measured: float
    predicted: float

    @property
    def ratio(self) -> float:
        """predicted / measured."""
        return self.predicted / self.measured

    @property
    def abs_error(self) -> float:
        """|predicted - measured| / measured."""
        return abs(self.ratio - 1.0)


def compare_phases(
    rows: Sequence[Mapping[str, Any]],
) -> tuple[list[PhaseComparison], dict[str, dict[str, float]], list[tuple[str, bool, bool]]]:
    """Compare predicted rows in the format of ``reference/h100_measured.csv`` with their measurements, per phase.

    Returns:
        The comparisons (rows and phases with a measurement and a prediction); per phase of
        :data:`MEASURED_PHASES` a summary ``rows``, ``median_abs_error``, ``max_abs_error`` (fractions); and the
        fit/OOM flips ``(name, ran, predicted to fit)``: rows whose ``oom`` (1: the run died) disagrees with
        ``pred_fits``.
    """
    comps, flips = [], []
    for r in rows:
        if r.get("pred_error"):
            continue
        for phase, (columns, pred) in MEASURED_PHASES.items():
            values = [v for v in (_float(r.get(c)) for c in columns) if v is not None]
            predicted = _float(r.get(pred))
            if values and predicted is not None:
                comps.append(PhaseComparison(str(r.get("name", "")), str(r.get("table", "")), phase, max(values),
                                             predicted))
        ran, fits = not row_flag(r.get("oom", "")), str(r.get("pred_fits")).lower() == "true"
        if ran != fits:
            flips.append((str(r.get("name", "")), ran, fits))
    summary = {}
    for phase in MEASURED_PHASES:
        errors = [c.abs_error for c in comps if c.phase == phase]
        summary[phase] = {
            "rows": float(len(errors)),
            "median_abs_error": statistics.median(errors) if errors else float("nan"),
            "max_abs_error": max(errors) if errors else float("nan"),
        }
    return comps, summary, flips


def comparison_table(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """Markdown lines: per predicted row of a measured CSV (``reference/h100_measured.csv`` or
    ``reference/compiled_measured.csv``), the measured and predicted GiB of the step-1 phases and of the steady
    step, their ratio, and the run's outcome against the verdict; then the error summary per phase and the fit/OOM
    flips (:func:`compare_phases`)."""
    comps, summary, flips = compare_phases(rows)
    by = {(c.name, c.table, c.phase): c for c in comps}
    phases = ("step1 forward", "step1 backward", "step1 optimizer", "steady")
    lines = ["| row | table | step | " + " | ".join(f"{p}: measured / predicted (ratio)" for p in phases) + " | run |",
             "|---|---|---|" + "---:|" * len(phases) + "---|"]
    for r in rows:
        if r.get("pred_error"):
            lines.append(f"| {r.get('name', '')} | {r.get('table', '')} | error: {r['pred_error']} |" + " |" * 5)
            continue
        cells = []
        for phase in phases:
            c = by.get((str(r.get("name", "")), str(r.get("table", "")), phase))
            cells.append(f"{c.measured:.3f} / {c.predicted:.3f} ({c.ratio:.3f})" if c else "-")
        ran = "OOM" if row_flag(r.get("oom", "")) else "ran"
        verdict = "fits" if str(r.get("pred_fits")).lower() == "true" else "OOM"
        lines.append(f"| {r.get('name', '')} | {r.get('table', '')} | {r.get('pred_model_step', '')} | "
                     + " | ".join(cells) + f" | {ran}; predicted {verdict} |")
    lines += ["", "| phase | rows | median abs error | max abs error |", "|---|---:|---:|---:|"]
    for phase, s in summary.items():
        if s["rows"]:
            lines.append(f"| {phase} | {int(s['rows'])} | {s['median_abs_error']:.1%} | {s['max_abs_error']:.1%} |")
    lines += ["", f"Fit/OOM flips: {len(flips)}" + (f" ({', '.join(f[0] for f in flips)})" if flips else "") + "."]
    return lines
