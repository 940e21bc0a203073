"""``python preflight.py``: check configs for validity and GPU-memory fit before anything launches; no GPU needed.

    python preflight.py                                   every configs/experiment/*.yaml, as a table (eager)
    python preflight.py experiment=exp11 model.channels=[...]      one configuration, in detail (compiled)
    python preflight.py preflight.sweep=IN.csv preflight.recipe=seed preflight.out=OUT.csv   every row of a CSV
    python preflight.py experiment=exp11 preflight.measure=true     (CUDA GPU) measured peaks beside the prediction

Exit status (voxdiff.cli.exit_codes): 0 when every checked configuration is valid and fits; 2 (EXIT_CONFIG) when
one is invalid or the command line / sweep CSV is refused; 4 (EXIT_NO_FIT) when all are valid but one does not fit.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from omegaconf import DictConfig

from voxdiff.benchmarks.measure import measure_steps, reference_row, require_cuda, write_rows
from voxdiff.benchmarks.sweep import sweep
from voxdiff.cli.exit_codes import EXIT_CONFIG, EXIT_NO_FIT, EXIT_OK, command_line_refusal
from voxdiff.config import batch_size_is_auto, compose, config_dir, resolved_for
from voxdiff.files import check_output
from voxdiff.errors import ConfigError, Problems, boolean, integer
from voxdiff.preflight.autofit import autofit
from voxdiff.preflight.check import PreflightResult, run_preflight, with_overrides
from voxdiff.run.gpus import resolve_gpu
from voxdiff.run.spec import preflight_options, run_spec
from voxdiff.step import recipe_from_config
from voxdiff.units import GiB


def _experiment_given(overrides: list[str]) -> bool:
    return any(o.lstrip("+~").split("=")[0] == "experiment" for o in overrides)


def _check(cfg: DictConfig, name: str, single: bool) -> PreflightResult:
    """One configuration: in detail (fixes, the compiled step traced compiled) when it is the only one; in the table
    over every experiment, seconds each: no fixes, a compiled run's step traced eagerly (an upper bound).

    ``data.batch_size=auto`` (or ``preflight.autofit=true`` for one configuration): the candidates of
    :func:`~voxdiff.preflight.autofit.autofit` are printed first, and with ``auto`` the chosen one is the
    configuration checked."""
    auto = batch_size_is_auto(cfg)
    if auto or (single and bool(cfg.preflight.get("autofit", False))):
        report = autofit(cfg, progress=lambda line: print(f"data.batch_size=auto: {line}", flush=True))
        print(report.table() + "\n")
        if auto and report.best is None:  # the verdict on batch 1, with its fixes
            print("data.batch_size=auto: no candidate fits; checking batch 1")
            cfg = with_overrides(cfg, {"data.batch_size": 1})
        elif auto:
            print(f"data.batch_size=auto: chosen {' '.join(report.best.overrides)}")
            cfg = with_overrides(cfg, dict(report.best.settings))
    return run_preflight(cfg, name=name, suggest=bool(cfg.preflight.suggest) and single, compile=single)


def _row(r: PreflightResult) -> list[str]:
    if r.problems:
        return [r.name, *["-"] * 9, f"{r.budget_gib:.0f}", "INVALID"]
    verdict = ("fits" if r.fits else "OUT OF MEMORY") + (" (" + ", ".join(e.key for e in r.misfits) + " refused)"
                                                         if r.misfits else "")
    if r.stage1 is not None:
        s1 = r.stage1
        return [r.name, "VQ-VAE " + "×".join(map(str, s1.batch_shape[1:])), "-", f"{r.params / 1e6:.1f}M", "-",
                f"stage 1{' (ckpt)' if s1.use_checkpoint else ''}", f"{max(s1.first_step.values()) / GiB:.1f}",
                f"{s1.peak_allocated / GiB:.1f}", r.peak_phase, f"{r.need_gib:.1f}", f"{r.budget_gib:.0f}", verdict]
    rep = r.report
    return [
        r.name,
        "×".join(map(str, r.shapes.unet_input)),
        str(r.levels),
        f"{r.params / 1e6:.1f}M",
        rep.attention,
        rep.model_step,
        f"{rep.first_step.peak / GiB:.1f}",
        f"{rep.steady_step.peak / GiB:.1f}",
        r.peak_phase,
        f"{r.need_gib:.1f}" + (f" ({r.strategy}×{r.world_size})" if r.world_size > 1 else ""),
        f"{r.budget_gib:.0f}",
        verdict,
    ]


HEADER = ["experiment", "UNet input", "levels", "params", "attention", "model", "step 1 GiB", "steady GiB",
          "peak set by", "need GiB", "budget", "verdict"]


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(str(row[i])) for row in [HEADER, *rows]) for i in range(len(HEADER))]
    line = lambda row: "  ".join(str(c).ljust(w) for c, w in zip(row, widths))  # noqa: E731
    return "\n".join([line(HEADER), line(["-" * w for w in widths]), *map(line, rows)])


def details(r: PreflightResult) -> str:
    """The problems, the memory summary, the verdict and the fixes of one configuration (indented lines)."""
    out = []
    for p in r.problems:
        out.append(f"  ✗ {p}")
    if r.stage1 is not None:
        out.append("  " + r.stage1.describe())
        out.append(f"  per GPU: peak {r.per_gpu_peak_gib:.2f} GiB ({r.peak_phase}); needs {r.need_gib:.1f} GiB with "
                   f"the safety margin and CUDA context; budget {r.budget_gib:.1f} GiB ({r.budget_source}): "
                   + ("fits" if r.fits else "DOES NOT FIT"))
    if r.report is not None:
        out.append("  " + r.report.summary().replace("\n", "\n  "))
        if r.phases is not None:
            held, budgeted = r.report.graph_pool_bytes, r.report.graph_pool_needed
            out.append("  phases: " + r.phases.describe() + (
                f" (allocated peaks; the CUDA graphs' pool, {held / GiB:.2f} GiB simulated and {budgeted / GiB:.2f} "
                "budgeted, stays reserved beside validation and sampling: the per-GPU line is the verdict's)"
                if held else ""))
        where = r.parallel.describe() if r.parallel is not None else "one GPU"
        if r.peak_phase == "training":
            pools = ", reserved: its CUDA graphs keep their pool" if r.report.peak_needed > r.report.peak_allocated else ""
        else:
            pools = " beside the CUDA graphs' pool" if r.report.graph_pool_bytes else ""
        by = f"{r.peak_phase}{pools}"
        out.append(f"  per GPU: peak {r.per_gpu_peak_gib:.2f} GiB ({where}, set by {by}); needs {r.need_gib:.1f} GiB with the "
                   f"safety margin and CUDA context; budget {r.budget_gib:.1f} GiB ({r.budget_source}): "
                   + ("fits" if r.fits else "DOES NOT FIT"))
        if r.data is not None and r.parallel is not None:
            out.append(f"  data in host memory: {r.data.describe(r.parallel)}")
    if r.needs is not None:
        out.extend(f"  {line}" for line in r.needs.lines())
        out.extend(f"  ! {w}" for w in r.needs.warnings)
        out.extend(f"  ✗ {e}" for e in r.misfits)
    if r.suggestions:
        out.append(("  changes that fit (predicted per-GPU peak / need" if any(s.fits for s in r.suggestions)
                    else "  no single change fits; predicted effect of each (per-GPU peak / need")
                   + (f"; {r.suggestions_step} step, an upper bound of the compiled one)"
                      if r.suggestions_step == "eager" and r.report.model_step == "compiled" else ")") + ":")
        for s in r.suggestions:
            mark = "✓" if s.fits else "✗"
            out.append(f"    {mark} {s.change}: {' '.join(s.overrides)}  ->  {s.peak_gib:.1f} / {s.need_gib:.1f} GiB")
    return "\n".join(out)


def _sweep(cfg: DictConfig) -> int:
    p = cfg.preflight
    if not p.out:
        raise ConfigError("preflight.out", p.out, "sweep mode writes a CSV", "add preflight.out=OUT.csv")
    check_output("preflight.out", str(p.out), folder=False, fix="give a CSV path in a folder that exists")
    plot = str(p.plot) if p.plot else str(Path(str(p.out)).with_suffix(".png"))
    check_output("preflight.plot", plot, folder=False, fix="give a PNG path in a folder that exists")
    src = Path(str(p.sweep))
    if not src.is_file():
        raise ConfigError("preflight.sweep", p.sweep, "no such file", "give the path of a CSV in the format of "
                          "reference/measured_vram.csv")
    recipe = recipe_from_config(cfg) if p.recipe is not None else None
    t0 = time.perf_counter()
    budget = preflight_options(cfg).gpu_memory_gib  # None: each row's GPU's memory
    rows = sweep(src, str(p.out), recipe, system=recipe_from_config(cfg, "system"), budget_gib=budget,
                 safety_margin=float(p.safety_margin), plot_path=plot, gpu=resolve_gpu(cfg)[0])
    bad = [r for r in rows if r.get("pred_error")]
    print(f"preflight sweep: {len(rows)} rows from {src} -> {p.out} and {plot} in {time.perf_counter() - t0:.1f} s"
          + (f"; {len(bad)} invalid rows (pred_error)" if bad else ""))
    return EXIT_OK


def _measure(cfg: DictConfig, result: PreflightResult) -> None:
    run = run_spec(cfg, "cuda")  # on this GPU node: the local GPU's precision
    measured = measure_steps(run, int(cfg.preflight.measure_steps))
    row = reference_row(run, result.name, measured, result.report)
    print("measured:", ", ".join(f"{k} {row[k]}" for k in ("fwd_gib", "bwd_gib", "total_gib", "steady_total_gib",
                                                            "reserved_gib", "oom") if k in row))
    if cfg.preflight.out:
        print(f"measured row -> {write_rows(str(cfg.preflight.out), [row])}")


def run(overrides: list[str]) -> int:
    """Run the preflight for command-line ``overrides``; returns the exit status (config errors are printed)."""
    from hydra.errors import HydraException

    try:
        with resolved_for("gpu"):  # resolve ${voxdiff.cpu_or:...} as the GPU run will
            return _run(overrides)
    except HydraException as err:  # a command line Hydra cannot compose: refused as train.py refuses it
        print(f"[voxdiff] config error: {command_line_refusal(err, overrides)}", file=sys.stderr)
        return EXIT_CONFIG
    except ConfigError as err:  # a refused value
        print(f"[voxdiff] config error: {err}", file=sys.stderr)
        return EXIT_CONFIG


def check_switches(cfg: DictConfig) -> None:
    """The command's own switches, before anything is predicted: ``preflight.suggest``, ``.autofit`` and ``.measure``
    true or false; ``preflight.measure_steps`` at least 2 (step 1, then the steady state).

    Raises:
        ConfigError: naming the key, the value and a fix (every problem at once).
    """
    options = cfg.preflight
    collect = Problems()
    for key in ("suggest", "autofit", "measure"):
        collect(lambda key=key: boolean(f"preflight.{key}", options.get(key, False)))
    collect(lambda: integer("preflight.measure_steps", options.get("measure_steps", 3), minimum=2,
                            fix="e.g. preflight.measure_steps=3 (step 1, then the steady state)"))
    collect.raise_all()


def _run(overrides: list[str]) -> int:
    base = compose("preflight", overrides)
    check_switches(base)
    if base.preflight.measure:  # refused now on a machine without a GPU, not after the prediction
        require_cuda()
    if base.preflight.measure and base.preflight.out:  # the measured row is written after minutes on the GPU
        check_output("preflight.out", str(base.preflight.out), folder=False, fix="give a CSV path in a folder that "
                     "exists")
    if base.preflight.sweep:
        return _sweep(base)
    if _experiment_given(overrides):
        configs = [(str(base.task_name), base)]
    else:
        names = sorted(p.stem for p in (config_dir() / "experiment").glob("*.yaml"))
        configs = [(n, compose("preflight", [f"experiment={n}", *overrides])) for n in names]
    single = len(configs) == 1
    results = []
    for name, cfg in configs:
        results.append(_check(cfg, name, single))
    print(_table([_row(r) for r in results]))
    for r in results:
        if single or not r.ok:
            print(f"\n{r.name}:\n{details(r)}")
    if single and base.preflight.measure:
        _measure(base, results[0])
    if any(r.report is not None and r.report.model_step == "upper bound (eager)" for r in results) and not single:
        print("\nmodel 'upper bound (eager)': the run compiles its model; the table traces it eagerly (seconds, an "
              "upper bound); python preflight.py experiment=NAME predicts the compiled step")
    failed = [r.name for r in results if not r.ok]
    print(f"\npreflight: {len(results) - len(failed)}/{len(results)} configurations valid and fit"
          + (f"; refused: {', '.join(failed)}" if failed else ""))
    if any(r.problems for r in results):
        return EXIT_CONFIG
    return EXIT_NO_FIT if failed else EXIT_OK


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in args):
        print(__doc__)
        return EXIT_OK
    code = run(args)
    if argv is None:
        sys.exit(code)
    return code
