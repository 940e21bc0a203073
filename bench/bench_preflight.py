"""Benchmark and validate the preflight memory predictor on the measured reference table.

Usage::

    .venv/bin/python bench/bench_preflight.py                 # seconds per configuration, mean / max
    .venv/bin/python bench/bench_preflight.py --table docs/preflight_error_table.md   # also write the error table
    .venv/bin/python bench/bench_preflight.py --csv IN.csv --bytes-csv OUT.csv   # exact bytes per phase and row

``--bytes-csv`` writes every row's predicted peaks in bytes (no rounding), so two versions of the preflight can be
compared row by row with ``diff``: a refactor of the traced step must leave them unchanged.

The reference CSV is ``reference/measured_vram.csv`` of the repository (``$VOXDIFF_REFERENCE_CSV`` or ``--csv``
override it). GiB = 2**30 bytes.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from voxdiff.preflight.memory import DEFAULT_SAFETY_MARGIN
from voxdiff.preflight.sweep import PRED_COLUMNS, compare_to_measured, plot_sweep, predict_row
from voxdiff.step import SEED

ROOT = Path(__file__).resolve().parents[1]
_CANDIDATES = [os.environ.get("VOXDIFF_REFERENCE_CSV", ""), str(ROOT / "reference" / "measured_vram.csv")]

# Attention from level 1 (40x32x32 = 40960 tokens) at the s2d input 80x64x64: the configurations whose runs
# died out of memory. The exact seed list is not in the reference CSV; these are the s2d families of the table
# with attention moved up to level 1.
_S2D = {"input_shape": "16x80x64x64", "in_channels": "16", "out_channels": "8", "num_head_channels": "32",
        "grad_checkpointing": "0"}  # fmt: skip
SEED_OOM_CONFIGS: list[dict[str, str]] = [
    {**_S2D, "name": "4L [64,128,256,512] attn-L123", "channels": "64 128 256 512",
     "attention_levels": "0 1 1 1", "num_res_blocks": "2 2 2 2", "norm_num_groups": "32"},
    {**_S2D, "name": "4L [64,128,256,512] attn-L1", "channels": "64 128 256 512",
     "attention_levels": "0 1 0 0", "num_res_blocks": "2 2 2 2", "norm_num_groups": "32"},
    {**_S2D, "name": "5L [64,128,256,512,512] attn(1,2,3,4)", "channels": "64 128 256 512 512",
     "attention_levels": "0 1 1 1 1", "num_res_blocks": "1 1 2 2 2", "norm_num_groups": "32"},
    {**_S2D, "name": "5L [32,64,256,512,1024] attn(1,2,3,4)", "channels": "32 64 256 512 1024",
     "attention_levels": "0 1 1 1 1", "num_res_blocks": "1 1 2 2 2", "norm_num_groups": "32"},
    {**_S2D, "name": "5L [16,32,128,256,512] attn(1,2,3,4)", "channels": "16 32 128 256 512",
     "attention_levels": "0 1 1 1 1", "num_res_blocks": "1 1 2 2 2", "norm_num_groups": "16"},
]  # fmt: skip


def _reference(path: str | None) -> Path:
    for p in [path, *_CANDIDATES]:
        if p and Path(p).is_file():
            return Path(p)
    sys.exit("measured_vram.csv not found; pass --csv or set VOXDIFF_REFERENCE_CSV")


BYTES_COLUMNS = ["name", "params", "step1_fwd", "step1_bwd", "step1_opt", "steady_fwd", "steady_bwd", "steady_opt",
                 "peak_allocated", "estimated_reserved", "pred_error"]


def _bytes_row(row: dict[str, str], pred: dict[str, str], report) -> dict[str, object]:
    """The exact predicted bytes of one row (:data:`BYTES_COLUMNS`); empty figures for a row that failed."""
    out: dict[str, object] = dict.fromkeys(BYTES_COLUMNS, "")
    out.update(name=row.get("name", ""), pred_error=pred["pred_error"])
    if report is not None:
        s1, s2 = report.first_step, report.steady_step
        out.update(params=report.params, step1_fwd=s1.forward, step1_bwd=s1.backward, step1_opt=s1.optimizer,
                   steady_fwd=s2.forward, steady_bwd=s2.backward, steady_opt=s2.optimizer,
                   peak_allocated=report.peak_allocated, estimated_reserved=report.estimated_reserved)
    return out


def _predict_all(
    rows: list[dict[str, str]], bytes_rows: list[dict[str, object]] | None = None, **kwargs
) -> tuple[list[dict[str, str]], list[float]]:
    out, seconds = [], []
    for row in rows:
        t0 = time.perf_counter()
        pred, report = predict_row(row, **{"recipe": SEED, **kwargs})
        seconds.append(time.perf_counter() - t0)
        out.append({**row, **pred})
        if bytes_rows is not None:
            bytes_rows.append(_bytes_row(row, pred, report))
    return out, seconds


def _error_table(
    rows_lightning: list[dict[str, str]], rows_after: list[dict[str, str]]
) -> tuple[list[str], dict[str, float]]:
    comps, summary = compare_to_measured(rows_lightning)
    comps_after, summary_after = compare_to_measured(rows_after)
    after = {c.name: c for c in comps_after}
    lines = [
        "| row | table | compared | measured GiB | predicted GiB | ratio | zero_grad after step: GiB | ratio |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for c in comps:
        a = after[c.name]
        lines.append(
            f"| {c.name} | {c.table} | {c.figure.removeprefix('pred_').removesuffix('_gib')} | {c.measured:.2f} | "
            f"{c.predicted:.2f} | {c.ratio:.2f} | {a.predicted:.2f} | {a.ratio:.2f} |"
        )
    lines += [
        "",
        f"- Lightning order (default): median |error| **{summary['median_abs_error']:.1%}**, "
        f"max **{summary['max_abs_error']:.1%}**, fit/OOM flips **{int(summary['flips'])}** "
        f"over {int(summary['rows'])} rows.",
        f"- zero_grad right after `optimizer.step()`: median |error| {summary_after['median_abs_error']:.1%}, "
        f"max {summary_after['max_abs_error']:.1%}, flips {int(summary_after['flips'])}.",
    ]
    return lines, summary_after


def _param_table(rows: list[dict[str, str]]) -> list[str]:
    lines = ["| row | reported M | predicted M | difference |", "|---|---:|---:|---:|"]
    for r in rows:
        if r.get("params_m"):
            rep, pred = float(r["params_m"]), float(r["pred_params_m"])
            lines.append(f"| {r['name']} | {r['params_m']} | {pred:.3f} | {pred / rep - 1:+.2%} |")
    return lines


def _seed_table(budget_gib: float) -> list[str]:
    lines = [
        "| configuration | params M | materialised: peak GiB | fits? | flash: step 1 GiB | steady GiB | fits? |",
        "|---|---:|---:|---|---:|---:|---|",
    ]
    for cfg in SEED_OOM_CONFIGS:
        mat, _ = predict_row(cfg, SEED, budget_gib=budget_gib)
        fla, _ = predict_row({**cfg, "use_flash_attention": "1"}, SEED, budget_gib=budget_gib)
        peak_mat = max(float(mat["pred_step1_gib"]), float(mat["pred_steady_gib"]))
        lines.append(
            f"| {cfg['name']} | {fla['pred_params_m']} | {peak_mat:.1f} | {mat['pred_fits']} | "
            f"{fla['pred_step1_gib']} | {fla['pred_steady_gib']} | {fla['pred_fits']} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--csv", help="reference CSV (measured_vram.csv format)")
    ap.add_argument("--out-csv", help="also write the predictions here (and a PNG next to it)")
    ap.add_argument("--table", help="write the markdown error table here")
    ap.add_argument("--bytes-csv", help="write every row's predicted peaks in bytes here (for diffs)")
    ap.add_argument("--budget-gib", type=float, default=80.0)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)

    ref = _reference(args.csv)
    with open(ref, newline="") as fh:
        rows = list(csv.DictReader(fh))

    t0 = time.perf_counter()
    predict_row({**SEED_OOM_CONFIGS[0], "channels": "32 32 32 32", "attention_levels": "0 0 0 0",
                 "input_shape": "16x8x8x8"}, SEED)  # fmt: skip
    print(f"warm-up (imports, first meta kernels): {time.perf_counter() - t0:.2f} s")

    bytes_rows: list[dict[str, object]] = []
    out, seconds = _predict_all(rows, bytes_rows, budget_gib=args.budget_gib)
    width = max(len(r["name"]) for r in rows)
    print(f"{'configuration':{width}s}  params M   peak GiB  seconds")
    for r, s in zip(out, seconds):
        peak = max(float(r["pred_step1_gib"] or 0), float(r["pred_steady_gib"] or 0))
        print(f"{r['name']:{width}s}  {r['pred_params_m']:>8s}  {peak:9.2f}  {s:7.2f}  {r['pred_error']}")
    print(f"{len(seconds)} configurations: mean {statistics.mean(seconds):.2f} s, max {max(seconds):.2f} s, "
          f"total {sum(seconds):.1f} s")  # fmt: skip

    if args.out_csv:
        with open(args.out_csv, "w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=list(rows[0]) + [c for c in PRED_COLUMNS if c not in rows[0]])
            writer.writeheader()
            writer.writerows(out)
        plot_sweep(out, Path(args.out_csv).with_suffix(".png"), budget_gib=args.budget_gib)

    if args.bytes_csv:
        with open(args.bytes_csv, "w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=BYTES_COLUMNS)
            writer.writeheader()
            writer.writerows(bytes_rows)
        print(f"wrote {args.bytes_csv}")

    if args.table:
        after_step = dataclasses.replace(SEED, name="seed, zero_grad after step", zero_grad_at="after_step")
        out_after, _ = _predict_all(rows, budget_gib=args.budget_gib, recipe=after_step)
        error_lines, summary_after = _error_table(out, out_after)
        big = [s for r, s in zip(out, seconds) if float(r["pred_params_m"] or 0) >= 2500]
        text = [
            "# Preflight error table",
            "",
            "Generated by `.venv/bin/python bench/bench_preflight.py --table docs/preflight_error_table.md` from",
            "`reference/measured_vram.csv` (peak `torch.cuda.max_memory_allocated()` of real A100/H100 steps,",
            "batch 1, bf16 AMP, foreach AdamW). GiB = 2**30 bytes. Predictions: `voxdiff.preflight.sweep.predict_row`",
            "(MONAI `DiffusionModelUNet` traced on the meta device; nothing fitted to this table).",
            "",
            "Compared figure: the first step's peak (`step1`, optimizer step included) for `latent8x` rows, the",
            "steady-state peak (`steady`, a later step with the AdamW state alive) for `s2d128` rows, as the",
            "reference README describes. The default steady state releases the previous step's gradients the way",
            "Lightning's automatic optimisation does (`zero_grad` after the forward, before `backward`); the last",
            "two columns release them right after `optimizer.step()` instead.",
            "",
            f"Verdict (`pred_fits`): `peak_allocated * (1 + {DEFAULT_SAFETY_MARGIN:g}) + 0.5 GiB CUDA context <= "
            f"{args.budget_gib:g} GiB`.",
            "",
            "## Peak memory",
            "",
            *error_lines,
            "",
            "## Parameter counts",
            "",
            *_param_table(out),
            "",
            "## Seed configurations that ran out of memory (attention from level 1 at 80x64x64)",
            "",
            "The seed list itself is not in the reference; these are the s2d families of the table with attention",
            "moved up to level 1 (40x32x32 = 40960 tokens). `materialised`: MONAI's default attention",
            "(`use_flash_attention=False`, scores in memory); `flash`: `use_flash_attention=True`, which SDPA runs",
            "as FlashAttention-2 on sm80+ GPUs in bf16.",
            "",
            *_seed_table(args.budget_gib),
            "",
            "With flash attention every one fits. A configuration predicted to fit *with* materialised scores is",
            "marginal: if a score element cost twice the traced 6 B, as the level-2 rows below suggest, the scores",
            "of its level-1 blocks would double.",
            "",
            "## Reading the table",
            "",
            "- The large latent rows are the first step's `optimizer.step()`: parameters, gradients, `exp_avg`,",
            "  `exp_avg_sq` and foreach AdamW's `sqrt(exp_avg_sq)` temporary, five fp32 copies of the parameters.",
            "- The small latent rows (and, by 0.2-1 GiB growing with the width, the forward peaks `fwd_gib` of all",
            "  latent rows) are under-predicted. Memory a kernel takes that the trace cannot see would do this;",
            "  cuDNN's convolution workspaces are the largest such item and are not modelled (they depend on the",
            "  algorithm cuDNN picks); no constant was added for them.",
            "- The two s2d rows with attention at level 2 (20x16x16 = 5120 tokens, 8 heads) are under-predicted by",
            "  about 30 %. The trace keeps 6 B per score element per attention block (the fp32 softmax output and",
            "  its bf16 copy, from CUDA autocast's softmax and einsum policies); the measurements imply about twice",
            "  that. The latent rows' level-1 attention (2560 tokens, 16 heads for 3L_huge) shows no such excess,",
            "  so the difference is not a constant factor and is left unexplained rather than fitted.",
            "- Steady state: Lightning's automatic optimisation calls `zero_grad` after the forward, so the previous",
            "  step's gradients (4 B per parameter) are alive during the forward. Released right after",
            "  `optimizer.step()` instead (last two columns; the latent rows do not change), all rows agree to a",
            f"  median of {summary_after['median_abs_error']:.1%}: the reference runs most likely released them before",
            "  the forward.",
            "- Parameter counts: `4L [64,128,256,512] no-attn` reports 159 M, but MONAI's `DiffusionModelUNet` always",
            "  has an attention block in its middle block (1.05 M parameters at 512 channels); without it the count",
            "  is 159.00 M. The other rows agree within the precision the reference reports (68 means 67.5-68.5).",
            "",
            "## Speed",
            "",
            f"{len(seconds)} configurations on this 2-core machine (shared with other jobs): mean "
            f"{statistics.mean(seconds):.2f} s, max {max(seconds):.2f} s per configuration"
            + (f"; the 2.7-3.5 B-parameter rows: max {max(big):.2f} s." if big else "."),
            "",
        ]
        Path(args.table).write_text("\n".join(text))
        print(f"wrote {args.table}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
