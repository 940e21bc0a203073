"""Measure the peak GPU memory (and step time) of UNet training steps for rows of a sweep CSV, on a CUDA GPU.

    python bench/measure_rows.py --csv reference/h100_measured.csv --rows 0,13,28 --out measured.csv \
        [--experiments exp11,exp9_ldm_4x_bravo] [--compile 1] [--optimizer-impl fused] [--zero-grad-at after_step] \
        [--flash 1] [--steps 6] [--jobs 4] [--budget-gib 70]

The step is the reference's (``voxdiff.step.SEED``: the seed's eps-MSE loss in fp32, bf16 autocast, batch 1, the
model from the sweep's factory built on the GPU) with the variations the flags name: the AdamW implementation,
when gradients are freed, SDPA attention (``use_flash_attention``) and ``torch.compile(model)``. Each row runs in its
own process: ``s1_*`` are the peaks of step 1's phases (``max_memory_allocated`` after a reset at each phase's
start), ``steady_gib`` the peak over steps 2..``--steps``, ``step_s`` the median wall time of steps 3..``--steps``
(synchronised), ``compile_s`` the wall time of step 1 minus the median (the compile warm-up), ``tflops`` the FLOPs
of one forward+backward (``torch.utils.flop_counter``) per step time.

``--jobs N`` runs N rows at a time on the one GPU, with a memory budget (``--budget-gib``) shared by the rows'
predicted peaks: peaks are per process and stay exact, but step times are then disturbed and left blank. The
output has the columns of ``reference/h100_measured.csv`` plus ``compile``, ``optimizer_impl``, ``zero_grad_at``
and ``use_flash_attention``, so ``bench/bench_preflight.py`` and the preflight's sweep read it as it is.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

GiB = 1024**3
ROW_COLUMNS = ["table", "name", "input_shape", "in_channels", "out_channels", "channels", "attention_levels",
               "num_res_blocks", "num_head_channels", "norm_num_groups", "grad_checkpointing"]


def experiment_row(name: str) -> dict[str, str]:
    """The UNet row of an experiment (its model and UNet input), in the reference CSV's columns."""
    from voxdiff.config import compose, model_spec, shapes

    cfg = compose("train", [f"experiment={name}"])
    spec, s = model_spec(cfg), shapes(cfg)
    return {
        "table": "experiment", "name": name, "input_shape": "x".join(map(str, s.unet_input)),
        "in_channels": str(spec.in_channels), "out_channels": str(spec.out_channels),
        "channels": " ".join(map(str, spec.channels)),
        "attention_levels": " ".join(str(int(a)) for a in spec.attention_levels),
        "num_res_blocks": " ".join(map(str, spec.num_res_blocks)),
        "num_head_channels": str(spec.num_head_channels[0]), "norm_num_groups": str(spec.norm_num_groups),
        "grad_checkpointing": str(int(spec.gradient_checkpointing != "none")),
    }


def measure_one(row: dict[str, str], opts: dict[str, Any]) -> dict[str, Any]:
    """Run the step of ``row`` on the current CUDA device (in this process); the measured columns."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from voxdiff.preflight.memory import unet_batch
    from voxdiff.benchmarks.measure import CudaPhasePeaks
    from voxdiff.benchmarks.sweep import MODEL_FACTORY, parse_row
    from voxdiff.step import SEED, TrainStep, decide_precision
    from voxdiff.step.optim import OptimSettings

    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    row = {**row, "use_flash_attention": str(opts["flash"])}
    cfg = parse_row(row)
    impl = opts["optimizer_impl"]
    optim = OptimSettings(lr=1e-4, weight_decay=0.0, foreach={"foreach": True, "single": False}.get(impl),
                          fused=True if impl == "fused" else None)
    recipe = replace(SEED, optim=optim, zero_grad_at=opts["zero_grad_at"])
    out: dict[str, Any] = {"oom": 0, "oom_phase": ""}
    torch.cuda.reset_peak_memory_stats()
    with torch.device("cuda"):
        model = MODEL_FACTORY(cfg)
    shapes, mode = unet_batch(cfg.input_shape, cfg.spec.out_channels)
    batch = {k: torch.randn(v, device="cuda") for k, v in shapes.items()}
    step = TrainStep(model, recipe, mode=mode, precision=decide_precision("bf16-mixed", "cuda").context(),
                     device_type="cuda")
    step.configure_optimizer()
    out["params_m"] = f"{sum(p.numel() for p in model.parameters()) / 1e6:.3f}"
    out["model_gib"] = torch.cuda.max_memory_allocated() / GiB
    if opts["compile"]:
        step.model = torch.compile(model, mode=opts["compile_mode"])
    times: list[float] = []
    phase = "step1"
    try:
        for i in range(1, opts["steps"] + 1):
            probe = CudaPhasePeaks()
            if i == 2:
                torch.cuda.reset_peak_memory_stats()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            phase = f"step{i}"
            if i == 1:
                step.run(batch, probe)
                for k, name in (("forward", "fwd"), ("backward", "bwd"), ("optimizer", "opt")):
                    out[f"s1_{name}"] = probe.peaks[k] / GiB
                out["step1_gib"] = max(probe.peaks.values()) / GiB
            else:
                step.run(batch)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        out["steady_gib"] = torch.cuda.max_memory_allocated() / GiB
        out["reserved_gib"] = torch.cuda.max_memory_reserved() / GiB
        median = statistics.median(times[2:]) if len(times) > 2 else times[-1]
        out["step_s"] = median
        out["compile_s"] = times[0] - median if opts["compile"] else 0.0
        step.zero_grad_before_backward()
        with FlopCounterMode(display=False) as counter:  # one forward+backward of the eager model
            eager = replace(recipe, zero_grad_at="after_step")
            flops_step = TrainStep(model, eager, mode=mode,
                                   precision=decide_precision("bf16-mixed", "cuda").context(), device_type="cuda")
            with flops_step.precision.forward():
                loss, _ = flops_step.loss(batch)
            loss.backward()
        model.zero_grad(set_to_none=True)
        out["tflop_per_step"] = counter.get_total_flops() / 1e12
        out["tflops"] = out["tflop_per_step"] / median
    except torch.OutOfMemoryError:
        out.update(oom=1, oom_phase=phase)
    out["gpu"] = torch.cuda.get_device_name()
    out["torch"] = torch.__version__
    return {k: (f"{v:.3f}" if isinstance(v, float) else v) for k, v in out.items()}


def expected_gib(row: dict[str, str]) -> float:
    """What the row is expected to take, GiB: the measured peak of the reference's step (foreach AdamW,
    materialised attention, eager: an upper bound for the variants) where the row has one, else the preflight's
    prediction of that step; 79 where neither is known (the row then runs alone)."""
    from voxdiff.benchmarks.sweep import predict_row
    from voxdiff.step import SEED

    known = [row.get("step1_gib"), row.get("steady_gib")]
    if all(known):
        return max(float(v) for v in known)  # type: ignore[arg-type]
    pred, _ = predict_row({**row, "use_flash_attention": "0"}, SEED)
    try:
        return max(float(pred["pred_step1_gib"]), float(pred["pred_steady_gib"]))
    except ValueError:
        return 79.0


def write_csv(path: str, results: list[dict[str, Any]]) -> None:
    """Write ``results`` to ``path`` atomically (a temporary file beside it, then a rename)."""
    columns: list[str] = []
    for r in results:
        columns += [c for c in r if c not in columns]
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns)
        w.writeheader()
        w.writerows(results)
    os.replace(tmp, path)


def run_all(rows: list[dict[str, str]], expected: list[float], opts: dict[str, Any], jobs: int, budget: float,
            out: str | None = None) -> list[dict[str, Any]]:
    """Each row in a child process (``--worker``), at most ``jobs`` at a time, the sum of their ``expected`` GiB
    within ``budget``; the rows done so far are written to ``out`` after each one."""
    need = [min(e * 1.1 + 1.0, budget) for e in expected]
    pending = sorted(range(len(rows)), key=lambda i: -need[i])
    running: dict[int, tuple[subprocess.Popen, float]] = {}
    results: dict[int, dict[str, Any]] = {}
    while pending or running:
        used = sum(n for _, n in running.values())
        for i in list(pending):
            if len(running) < jobs and used + need[i] <= budget:
                arg = json.dumps({"row": rows[i], "opts": opts})
                running[i] = (subprocess.Popen([sys.executable, __file__, "--worker", arg], stdout=subprocess.PIPE,
                                               text=True), need[i])
                used += need[i]
                pending.remove(i)
        time.sleep(0.5)
        for i, (proc, _) in list(running.items()):
            if proc.poll() is None:
                continue
            text = proc.stdout.read() if proc.stdout else ""
            lines = [ln for ln in text.splitlines() if ln.startswith("{")]
            got = json.loads(lines[-1]) if lines else {"error": f"exit {proc.returncode}"}
            if jobs > 1:
                got.update(step_s="", tflops="")  # disturbed by the other rows on the GPU
            step_cols = {"compile": opts["compile"], "optimizer_impl": opts["optimizer_impl"],
                         "zero_grad_at": opts["zero_grad_at"], "use_flash_attention": opts["flash"]}
            results[i] = {**rows[i], **{k: str(v) for k, v in step_cols.items()}, **got}
            print(f"[{len(results)}/{len(rows)}] {rows[i]['name']}: steady {got.get('steady_gib')} GiB, "
                  f"step1 {got.get('step1_gib')}, step {got.get('step_s')} s, compile {got.get('compile_s')} s "
                  f"{got.get('error', '')}", flush=True)
            del running[i]
            if out:
                write_csv(out, [results[k] for k in sorted(results)])
    return [results[i] for i in range(len(rows))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--csv", help="a sweep CSV (e.g. reference/h100_measured.csv)")
    p.add_argument("--rows", default="", help="comma-separated row indices of --csv (default: all)")
    p.add_argument("--experiments", default="", help="comma-separated experiment names to add as rows")
    p.add_argument("--compile", type=int, default=0)
    p.add_argument("--compile-mode", default=None)
    p.add_argument("--optimizer-impl", default="foreach", choices=("foreach", "fused", "single"))
    p.add_argument("--zero-grad-at", default="before_backward", choices=("before_backward", "after_step"))
    p.add_argument("--flash", type=int, default=0)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--budget-gib", type=float, default=72.0)
    p.add_argument("--out", required=False)
    p.add_argument("--expect", help="a CSV this script wrote for the same rows (e.g. the eager variant): its "
                   "peaks size the rows' share of --budget-gib instead of the reference's")
    a = p.parse_args()
    if a.worker:
        job = json.loads(a.worker)
        print(json.dumps(measure_one(job["row"], job["opts"])), flush=True)
        return
    table: list[dict[str, str]] = []
    if a.csv:
        with open(a.csv, newline="") as f:
            full = list(csv.DictReader(f))
        table = [full[int(i)] for i in a.rows.split(",") if i.strip()] or full
    table += [experiment_row(n) for n in a.experiments.split(",") if n.strip()]
    rows = [{k: r.get(k, "") for k in ROW_COLUMNS} for r in table]
    expected = [expected_gib(r) for r in table]
    if a.expect:
        with open(a.expect, newline="") as f:
            seen = {(r["name"], r["input_shape"]): r for r in csv.DictReader(f)}
        for i, r in enumerate(rows):
            got = seen.get((r["name"], r["input_shape"]), {})
            if got.get("steady_gib") and got.get("step1_gib"):
                expected[i] = max(float(got["steady_gib"]), float(got["step1_gib"]))
    opts = {"compile": a.compile, "compile_mode": a.compile_mode, "optimizer_impl": a.optimizer_impl,
            "zero_grad_at": a.zero_grad_at, "flash": a.flash, "steps": a.steps}
    t0 = time.perf_counter()
    results = run_all(rows, expected, opts, a.jobs, a.budget_gib, a.out)
    print(f"{len(results)} rows in {time.perf_counter() - t0:.0f} s" + (f" -> {a.out}" if a.out else ""))


if __name__ == "__main__":
    main()
