"""Fit the preflight's time model to measured step times and print its error (CPU only, ~1 min).

    python bench/fit_step_time.py                    # fit on reference/h100_step_times.csv, check on h100_measured.csv
    python bench/fit_step_time.py --fit A.csv --check B.csv

The model (:mod:`voxdiff.preflight.resources`): ``seconds = tflop / tflops + ops * op_us / 1e6``, with the FLOPs
and the operator calls of one forward+backward counted on the meta device. For each step kind in the fit CSV
(``plain eager``: foreach AdamW, materialised attention; ``eager``: fused AdamW + flash SDPA; ``compiled``: the same
under ``torch.compile``) it prints the two constants fitted by least squares on the relative error, the error on
each row, and the leave-one-out error (each row predicted by constants fitted without it). Then it predicts every
row of the check CSV that has a ``step_s`` with the constants of that row's kind, and prints the error's median and
spread. The rows are in the format of ``reference/h100_measured.csv`` (optional columns ``optimizer_impl``,
``use_flash_attention``, ``compile``). Paste the ``eager``/``compiled`` constants into ``STEP_THROUGHPUT``.

Then the ``cudagraphs`` kind: voxdiff's own step with CUDA graphs, measured by ``bench/bench_gpu_step.py`` (the rows of
:data:`CUDAGRAPH_ROWS`), each experiment's cost counted from its config, less the step's passes over its weights
as those steps ran (each row says its EMA's and its gradients' bytes per parameter: the rows measured before
session 16 ran inside ``system.ema.start_step``, where the EMA copies the weights, 8 bytes, instead of averaging them,
12, and clipped by norm in place, 12 bytes) at the GPU's bandwidth (``voxdiff.preflight.resources.H100_BANDWIDTH``),
fitted with four terms (non-negative least squares on the relative error): the FLOPs, the operator calls, the
convolutions' weight bytes (``StepCost.conv_weight_bytes``: a fixed cost per convolution call) and the bytes the
operators touch (``StepCost.tensor_bytes``: the traffic, which grows with the batch). It prints the two-term fit of
the same rows beside it (the model before session 24), each row's error and leave-one-out error under both, and the
error of the four-term constants on the rows of :data:`H200_ROWS` (measured on an H200, not fitted) and of
:data:`H200_CHANNELS_LAST_ROWS` (the same step channels-last, the default of a compiled GPU run). Paste the
``cudagraphs`` constants into ``STEP_THROUGHPUT`` (the H200's entry takes the same).

    python bench/fit_step_time.py --runs logs/exp11/2026-11-27_10-00-00 [more run directories or measured.json]

``--runs``: the steady step every ``train.py`` run on a GPU timed and wrote to ``<run dir>/measured.json``
(:class:`voxdiff.lightning.callbacks.MeasuredRun`), at whatever batch it ran, with the resolved config it ran and
the GPU type it was predicted for. Each run's cost is recounted from its config as the preflight counts it
(:func:`voxdiff.preflight.check.run_step_cost`), its error under today's ``STEP_THROUGHPUT`` printed, and its step
kind fitted again with the runs added (the ``cudagraphs`` rows above, or the plain loops of its kind): the time
model's error at the batches users run, and constants that include them. A run whose step waited for its data
(no DataLoader workers, the loader's measured rate: ``voxdiff.preflight.resources.data_step_s``) is printed but not
fitted: its time is not the GPU's alone.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from bench_gpu_step import dense_peak  # noqa: E402  (the bench folder is on the path when a script in it runs)
from voxdiff.preflight.resources import (  # noqa: E402
    EMA_BYTES_PER_PARAM,
    EMA_COPY_BYTES_PER_PARAM,
    H100_BANDWIDTH,
)


def kind(row: dict[str, str]) -> str:
    if row.get("compile", "0") == "1":
        return "compiled"
    if row.get("use_flash_attention", "0") == "1" and row.get("optimizer_impl") == "fused":
        return "eager"
    if row.get("use_flash_attention", "0") != "1" and row.get("optimizer_impl", "foreach") == "foreach":
        return "plain eager"
    return "other"


def cost(row: dict[str, str]):
    import torch

    from voxdiff.preflight.memory import unet_batch
    from voxdiff.preflight.resources import step_cost
    from voxdiff.benchmarks.sweep import MODEL_FACTORY, parse_row

    cfg = parse_row(row)
    with torch.device("meta"):
        model = MODEL_FACTORY(cfg)
    batch, mode = unet_batch(cfg.input_shape, cfg.spec.out_channels)
    return step_cost(model, batch, mode)


#: the gradient passes of the rows measured before session 16 (bytes per parameter): the norm and the scaling in
#: place (4 + 8); clipping went into fused AdamW's kernel (4: the norm alone) only after them
IN_PLACE_CLIP_BYTES = 12
#: the gradient pass of today's step: the clipping norm reads the gradients once (the factor is applied in AdamW's kernel)
NORM_BYTES = 4
#: voxdiff's CUDA-graph step as measured: (CSV, its row, the experiment whose config it ran, the EMA's bytes per
#: parameter per step as it ran, the gradient passes' bytes per parameter as it ran). The rows before session 16 were
#: the first 13 to 25 steps of a run, inside the GPU's system.ema.start_step=1000: the EMA copied the weights every
#: step (EMA_COPY_BYTES_PER_PARAM), not averaged them. A row of today's step (bench_gpu_step.py sets start_step=0):
#: EMA_BYTES_PER_PARAM / the EMA's interval (12 / 10 by default), and 4 for the gradients' norm. A sixth element, where
#: present, lists the overrides the row ran with (its batch).
CUDAGRAPH_ROWS = [
    ("reference/h100_bench_gpu_step_v3.csv", "exp11_ro", "exp11", EMA_COPY_BYTES_PER_PARAM, IN_PLACE_CLIP_BYTES),
    ("reference/h100_bench_gpu_step_v3.csv", "exp9_ldm_4x_bravo_ro", "exp9_ldm_4x_bravo", EMA_COPY_BYTES_PER_PARAM,
     IN_PLACE_CLIP_BYTES),
    ("reference/h100_bench_gpu_step_v4.csv", "exp11_1", "exp11_1", EMA_COPY_BYTES_PER_PARAM, IN_PLACE_CLIP_BYTES),
    ("reference/h100_bench_gpu_step_v4.csv", "exp9_ldm_8x_bravo", "exp9_ldm_8x_bravo", EMA_COPY_BYTES_PER_PARAM,
     IN_PLACE_CLIP_BYTES),
    # session 17: today's step, the EMA averaging from step 0 (every 10th step by default; one pass in the 10 timed)
    ("reference/h100_bench_gpu_step_v5.csv", "exp9_ldm_4x_bravo", "exp9_ldm_4x_bravo", EMA_BYTES_PER_PARAM / 10,
     NORM_BYTES),
    ("reference/h100_bench_gpu_step_v5.csv", "exp9_ldm_8x_bravo", "exp9_ldm_8x_bravo", EMA_BYTES_PER_PARAM / 10,
     NORM_BYTES),
    ("reference/h100_bench_gpu_step_v5.csv", "exp9_ldm_8x_bravo_ema_every_step", "exp9_ldm_8x_bravo",
     EMA_BYTES_PER_PARAM, NORM_BYTES),
    # session 19: exp11 at batch 1 and at batch 32 (the batch the preflight chose for an H100), one machine
    ("reference/h100_bench_gpu_step_v6.csv", "exp11", "exp11", EMA_BYTES_PER_PARAM / 10, NORM_BYTES),
    ("reference/h100_bench_gpu_step_v6.csv", "exp11_b32", "exp11", EMA_BYTES_PER_PARAM / 10, NORM_BYTES,
     ["data.batch_size=32", "model.gradient_checkpointing=none"]),
    # session 25: exp9_ldm_4x_bravo at batch 2 (the batch the preflight chooses for an H100) and exp9_ldm_8x_bravo at
    # batch 1 beside the compiled loop, one machine
    ("reference/h100_bench_gpu_step_v7.csv", "E_e94_b2", "exp9_ldm_4x_bravo", EMA_BYTES_PER_PARAM / 10, NORM_BYTES,
     ["data.batch_size=2", "model.gradient_checkpointing=none"]),
    ("reference/h100_bench_gpu_step_v7.csv", "B_e98", "exp9_ldm_8x_bravo", EMA_BYTES_PER_PARAM / 10, NORM_BYTES),
]


#: voxdiff's CUDA-graph step measured on an H200 (the step of session 21 and after: the EMA averaging every 10th step
#: from step 0, the clipping norm's 4 bytes): not fitted; the H100's constants are checked on them
H200_ROWS = [
    ("reference/h200_bench_gpu_step.csv", "exp9_ldm_4x_bravo", "exp9_ldm_4x_bravo", EMA_BYTES_PER_PARAM / 10,
     NORM_BYTES),
    ("reference/h200_bench_gpu_step_v2.csv", "E_e94_b4", "exp9_ldm_4x_bravo", EMA_BYTES_PER_PARAM / 10, NORM_BYTES,
     ["data.batch_size=4", "model.gradient_checkpointing=none"]),
    ("reference/h200_bench_gpu_step_v2.csv", "I_e11_b32", "exp11", EMA_BYTES_PER_PARAM / 10, NORM_BYTES,
     ["data.batch_size=32", "model.gradient_checkpointing=none"]),
    ("reference/h200_bench_gpu_step_v2.csv", "K_e11_b1", "exp11", EMA_BYTES_PER_PARAM / 10, NORM_BYTES),
]

#: the same step channels-last (``model.channels_last=auto`` on a compiled GPU run since session 26) on an H200: not
#: fitted (the model was fitted to NCDHW steps, and counts a channels-last step as NCDHW); its error on them
H200_CHANNELS_LAST_ROWS = [
    ("reference/h200_bench_gpu_step_v3.csv", "B_e98_cl", "exp9_ldm_8x_bravo", EMA_BYTES_PER_PARAM / 10, NORM_BYTES),
    ("reference/h200_bench_gpu_step_v4.csv", "E11_b1", "exp11", EMA_BYTES_PER_PARAM / 10, NORM_BYTES),
    ("reference/h200_bench_gpu_step_v4.csv", "E111_b1", "exp11_1", EMA_BYTES_PER_PARAM / 10, NORM_BYTES),
    ("reference/h200_bench_gpu_step_v4.csv", "F_e11_b32", "exp11", EMA_BYTES_PER_PARAM / 10, NORM_BYTES,
     ["data.batch_size=32", "model.gradient_checkpointing=none"]),
]


def cudagraph_points(rows: list | None = None) -> list[tuple[str, object, float, float, float]]:
    """``(row, its StepCost, seconds less the weight passes, seconds, the passes' seconds)`` of :data:`CUDAGRAPH_ROWS`
    (or ``rows`` in its format), the passes at ``H100_BANDWIDTH``."""
    import torch

    from voxdiff.config import compose
    from voxdiff.preflight.check import run_spec_problems, traced_unet
    from voxdiff.preflight.resources import H100_BANDWIDTH, step_cost

    points = []
    for path, row_name, experiment, ema_bytes, grad_bytes, *overrides in (CUDAGRAPH_ROWS if rows is None else rows):
        row = next(r for r in csv.DictReader(open(ROOT / path)) if r["experiment"] == row_name)
        run, problems = run_spec_problems(compose("train", [f"experiment={experiment}", "trainer.accelerator=gpu",
                                                            "trainer.devices=1", *(overrides[0] if overrides else [])]),
                                          "cuda")
        assert not problems, problems
        with torch.device("meta"):
            model = traced_unet(run, ncdhw=True)  # as the preflight counts a step (the rows ran NCDHW)
        c = step_cost(model, run.batch, run.mode, run.encoding, grad_bytes_per_param=grad_bytes)
        seconds = float(row["voxdiff_ms_per_step"]) / 1e3
        passes = (c.weight_bytes + c.params * ema_bytes) / H100_BANDWIDTH
        points.append((f"{row_name} ({path.rsplit('/', 1)[1]})", c, seconds - passes, seconds, passes))
    return points


def run_points(paths: list[str]) -> list[tuple[str, str, str, object, float, float, float, float | None]]:
    """``(name, gpu, kind, its StepCost, seconds less the weight passes, seconds, the passes' seconds, predicted
    seconds with the wait for data)`` of each run's ``measured.json`` (a run directory or the file) that timed its
    step on a CUDA GPU;
    the others are named on stderr and left out."""
    import json

    import torch
    from omegaconf import OmegaConf

    from voxdiff.preflight.check import run_spec_problems, run_step_cost, traced_unet
    from voxdiff.preflight.resources import DATA_SLACK, STEP_THROUGHPUT, data_step_s, loader_rate, step_kind

    points = []
    for given in paths:
        path = Path(given) / "measured.json" if Path(given).is_dir() else Path(given)
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            sys.exit(f"fit_step_time: --runs {given}: cannot read {path} ({e})")
        step = record.get("step_time")
        if not step or not str(record.get("device", "")).startswith("cuda") or not record.get("config"):
            print(f"fit_step_time: {path}: no step timed on a CUDA GPU with its config; left out", file=sys.stderr)
            continue
        run, problems = run_spec_problems(OmegaConf.create(record["config"]), "cuda")
        if problems:
            sys.exit(f"fit_step_time: {path}: its config does not resolve here: {problems[0]}")
        with torch.device("meta"):
            cost = run_step_cost(run, traced_unet(run, ncdhw=True))  # as the preflight counts it
        kind = step_kind(run.unet.compile, run.unet.cuda_graphs)
        gpu = record.get("gpu") or "?"
        table = STEP_THROUGHPUT.get((gpu, kind))
        seconds = float(step["measured_ms"]) / 1e3
        passes = cost.weight_bytes / (table.bandwidth if table is not None else H100_BANDWIDTH)
        name = f"{path.parent.name} (batch {run.batch_size}, {step['steps']} steps)"
        predicted = table.seconds(cost) if table is not None else None
        data = record["config"].get("data") or {}
        workers = int(data.get("num_workers") or 0)
        rate = loader_rate(data, workers, tuple(run.shapes.volume))
        wall = data_step_s(predicted, run.batch_size, rate, workers)
        if predicted is not None and wall is not None and wall > predicted * (1 + DATA_SLACK):
            print(f"fit_step_time: {path}: its step waited for data (data.num_workers={workers}, about "
                  f"{run.batch_size / rate * 1e3:.0f} ms a step at the loader's measured rate): printed, not fitted",
                  file=sys.stderr)
            name += " [waited for data: not fitted]"
        points.append((name, gpu, kind, cost, seconds - passes, seconds, passes, wall))
    return points


def fit_terms(points: list[tuple[list[float], float]], lower: list[float] | None = None) -> list[float]:
    """The coefficients (seconds per unit of each term, none negative, none below its ``lower`` bound where given)
    minimising the squared relative error over ``(terms, seconds)``."""
    import numpy as np
    from scipy.optimize import lsq_linear, nnls

    a = np.array([[v / t for v in terms] for terms, t in points])
    if lower is None:
        x, _ = nnls(a, np.ones(len(points)))
    else:
        x = lsq_linear(a, np.ones(len(points)), bounds=(lower, np.inf), method="bvls").x
    return [float(v) for v in x]


def fit(points: list[tuple[float, int, float]]) -> tuple[float, float]:
    """``(tflops, op_us)`` minimising the squared relative error over ``(tflop, ops, seconds)``."""
    x_f, x_n = fit_terms([([f, n], t) for f, n, t in points])
    return (1.0 / x_f if x_f else float("inf")), x_n * 1e6  # FLOPs fitted to no cost: an unbounded rate


def predict(tflops: float, op_us: float, f: float, n: int) -> float:
    return f / tflops + n * op_us / 1e6


def four_terms(cost) -> list[float]:
    """The terms of the CUDA-graph step's model: TFLOP, operator calls, convolutions' weight bytes, tensor bytes."""
    return [cost.tflop, cost.ops, cost.conv_weight_bytes, cost.tensor_bytes]


def fit_four(points: list[tuple[object, float]], peak_tflops: float | None = None):
    """A :class:`~voxdiff.preflight.resources.Throughput` of the four terms fitted to ``(StepCost, seconds less the
    weight passes)`` (its bandwidth ``H100_BANDWIDTH``; a term fitted to zero is left out: its rate None). With
    ``peak_tflops`` the FLOP rate is held at or under the GPU's dense peak: a rate above it would mean the other terms
    carry time that grows with the FLOPs (session 25's eleven rows fitted 1058 TFLOP/s, above an H100's 989.4)."""
    from voxdiff.preflight.resources import Throughput

    lower = None if peak_tflops is None else [1.0 / peak_tflops, 0.0, 0.0, 0.0]
    f, n, w, b = fit_terms([(four_terms(c), t) for c, t in points], lower)
    return Throughput(1.0 / f if f else float("inf"), n * 1e6, "fit", H100_BANDWIDTH,
                      1.0 / w if w else None, 1.0 / b if b else None)


def constants(table) -> str:
    """How the fit prints a four-term Throughput (the rates in GB/s)."""
    rate = lambda v: "none" if v is None else f"{v / 1e9:.1f}"  # noqa: E731
    return (f"tflops={table.tflops:.1f} op_us={table.op_us:.1f} conv_weight_gbps={rate(table.conv_weight_rate)} "
            f"tensor_gbps={rate(table.tensor_rate)}")


def gpu_s(table, cost) -> float:
    """A four-term Throughput's seconds for ``cost`` without the weight passes (the points carry them apart)."""
    from dataclasses import replace

    return table.seconds(replace(cost, params=0))


def _pct(values: list[float]) -> str:
    s = sorted(values)
    return (f"median {statistics.median(s):+.1%}, |median| {statistics.median(abs(v) for v in s):.1%}, "
            f"10th..90th pct {s[len(s) // 10]:+.1%}..{s[(9 * len(s)) // 10]:+.1%}, max |err| {max(map(abs, s)):.1%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fit", default=str(ROOT / "reference" / "h100_step_times.csv"))
    parser.add_argument("--check", default=str(ROOT.parent / "shared" / "reference" / "h100_measured.csv"))
    parser.add_argument("--runs", nargs="*", default=[],
                        help="run directories (or their measured.json) of train.py runs on a GPU")
    args = parser.parse_args()

    from voxdiff.preflight.resources import STEP_THROUGHPUT

    fitted: dict[str, Any] = {}  # a kind: (tflops, op_us); cudagraphs: its four-term Throughput
    rows = [r for r in csv.DictReader(open(args.fit)) if r.get("step_s")]
    by_kind: dict[str, list[tuple[dict, float, int, float]]] = {}
    for r in rows:
        c = cost(r)
        by_kind.setdefault(kind(r), []).append((r, c.tflop, c.ops, float(r["step_s"])))
    print(f"fit: {args.fit} ({len(rows)} rows)")
    for k, pts in by_kind.items():
        if k == "other" or len(pts) < 3:
            continue
        tflops, op_us = fit([p[1:] for p in pts])
        fitted[k] = (tflops, op_us)
        print(f"\n{k}: tflops={tflops:.1f} op_us={op_us:.1f}")
        for i, (r, f, n, t) in enumerate(pts):
            loo = fit([p[1:] for j, p in enumerate(pts) if j != i])
            print(f"  {r['name']:20s} {r['input_shape']:14s} {f:7.2f} TFLOP {n:5d} ops  measured {t * 1e3:6.1f} ms"
                  f"  fit {predict(tflops, op_us, f, n) / t - 1:+6.1%}  leave-one-out "
                  f"{predict(*loo, f, n) / t - 1:+6.1%}")
    graphs = cudagraph_points()
    two = fit([(c.tflop, c.ops, t) for _, c, t, _, _ in graphs])
    print(f"\ncudagraphs, two terms (the model before session 24): tflops={two[0]:.1f} op_us={two[1]:.1f}")
    for i, (name, c, _, total, passes) in enumerate(graphs):
        loo = fit([(p[1].tflop, p[1].ops, p[2]) for j, p in enumerate(graphs) if j != i])
        print(f"  {name:40s} fit {(predict(*two, c.tflop, c.ops) + passes) / total - 1:+6.1%}  leave-one-out "
              f"{(predict(*loo, c.tflop, c.ops) + passes) / total - 1:+6.1%}")
    peak = dense_peak("H100")
    table = fit_four([(c, t) for _, c, t, _, _ in graphs], peak)
    fitted["cudagraphs"] = table
    print(f"\ncudagraphs: {constants(table)} (the FLOP rate held at or under the dense bf16 peak, {peak} TFLOP/s)")
    for i, (name, c, _, total, passes) in enumerate(graphs):
        loo = fit_four([(p[1], p[2]) for j, p in enumerate(graphs) if j != i], peak)
        print(f"  {name:40s} {c.tflop:7.2f} TFLOP {c.ops:5d} ops {c.conv_weight_bytes / 1e9:5.1f} + "
              f"{c.tensor_bytes / 1e9:6.1f} GB  measured {total * 1e3:6.1f} ms (weight passes {passes * 1e3:4.1f})  "
              f"fit {(gpu_s(table, c) + passes) / total - 1:+6.1%}  leave-one-out "
              f"{(gpu_s(loo, c) + passes) / total - 1:+6.1%}")
    for title, rows in (("H200 rows", H200_ROWS), ("H200 channels-last rows", H200_CHANNELS_LAST_ROWS)):
        print(f"\n{title} (not fitted) under these constants, the weight passes at H100_BANDWIDTH:")
        for name, c, _, total, passes in cudagraph_points(rows):
            print(f"  {name:40s} {c.tflop:7.2f} TFLOP  measured {total * 1e3:6.1f} ms  predicted "
                  f"{(gpu_s(table, c) + passes) / total - 1:+6.1%}")
    runs = run_points(args.runs)
    if args.runs:
        print(f"\nruns: {len(runs)} of {len(args.runs)} timed on a CUDA GPU")
    for name, gpu, k, c, _, total, passes, predicted in runs:
        now = f"{predicted / total - 1:+6.1%}" if predicted is not None else "no throughput for this GPU and kind"
        print(f"  {name:40s} {gpu} {k}: {c.tflop:7.2f} TFLOP {c.ops:5d} ops  measured {total * 1e3:7.1f} ms (weight "
              f"passes {passes * 1e3:4.1f})  STEP_THROUGHPUT {now}")
    for gpu, k in sorted({(p[1], p[2]) for p in runs}):
        mine = [(c, t, total, passes) for name, g, kk, c, t, total, passes, _ in runs
                if (g, kk) == (gpu, k) and "not fitted" not in name]
        base = ([(c, t) for _, c, t, _, _ in graphs] if k == "cudagraphs"
                else [(p[1], p[2], p[3]) for p in by_kind.get(k, [])]) if gpu == "H100" else []
        if len(base) + len(mine) < 2:
            print(f"  ({gpu}, {k}): {len(base) + len(mine)} point(s), too few to fit")
            continue
        if k == "cudagraphs":
            both = fit_four([*base, *((c, t) for c, t, _, _ in mine)], dense_peak(gpu))
            shown, errors = constants(both), [(gpu_s(both, c) + passes) / total - 1 for c, _, total, passes in mine]
        else:
            tflops, op_us = fit([*base, *((c.tflop, c.ops, t) for c, t, _, _ in mine)])
            shown = f"tflops={tflops:.1f} op_us={op_us:.1f}"
            errors = [(predict(tflops, op_us, c.tflop, c.ops) + passes) / total - 1 for c, _, total, passes in mine]
        print(f"({gpu}, {k}) with the runs: {shown} ({len(base)} rows + {len(mine)} runs); the runs' error under it: "
              + (", ".join(f"{e:+.1%}" for e in errors) or "none fitted"))
    for k in ("eager", "compiled"):
        table = STEP_THROUGHPUT.get(("H100", k))
        if table is not None and k in fitted:
            print(f"STEP_THROUGHPUT[('H100', '{k}')]: tflops={table.tflops} op_us={table.op_us} "
                  f"(fitted now: {fitted[k][0]:.1f}, {fitted[k][1]:.1f})")
    table = STEP_THROUGHPUT.get(("H100", "cudagraphs"))
    if table is not None:
        print(f"STEP_THROUGHPUT[('H100', 'cudagraphs')]: {constants(table)} "
              f"(fitted now: {constants(fitted['cudagraphs'])})")

    check = Path(args.check)
    if not check.is_file():
        print(f"\nno check CSV at {check}")
        return
    errors: dict[str, list[float]] = {}
    for r in csv.DictReader(open(check)):
        k = kind(r)
        if not r.get("step_s") or r.get("oom") == "1" or k not in fitted:
            continue
        c = cost(r)
        errors.setdefault(k, []).append(predict(*fitted[k], c.tflop, c.ops) / float(r["step_s"]) - 1)
    for k, errs in errors.items():
        print(f"\ncheck: {check.name}, {len(errs)} '{k}' rows with step_s: predicted/measured - 1: {_pct(errs)}")


if __name__ == "__main__":
    main()
