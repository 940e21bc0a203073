"""The convolutions of an experiment's training step, each timed alone in each memory layout, summed per step.

    python bench/bench_convs.py [--experiments exp11] [--settings NCDHW,NDHWC,NCDHW+autotune,NDHWC+autotune]
                                [--warmup 2] [--reps 5] [--rounds 3] [--top 12] [--out F.csv [--append]]
                                [override ...]

What the step's convolutions cost, and what channels-last (``model.channels_last=true``) or cuDNN's autotuner
(``trainer.benchmark=true``) would change, in seconds of GPU time and without compiling the step: #27's 3x for exp11
at batch 32 needs the step's kernels 1.38x faster (README, "What 3x would take"), and a compiled step takes two to
three minutes to warm up on a device call of ten.

For each experiment (``train.py`` config, the trailing overrides applied, e.g. ``data.batch_size=32``),
:func:`voxdiff.benchmarks.convs.step_convolutions` records every convolution call of one training step on the meta
device (the preflight's trace: forwards, backwards with the gradients each computes, checkpointing's recomputations)
and each distinct call is timed alone in each setting (:func:`~voxdiff.benchmarks.convs.time_convolution`; the
run's autocast dtype, bf16 on a GPU). A setting is a layout — ``NCDHW`` (contiguous, voxdiff's default) or
``NDHWC`` (``torch.channels_last_3d``) — with ``+autotune`` for ``torch.backends.cudnn.benchmark``. It prints the
calls that take the most time in the first setting (the baseline), then per setting the convolutions' milliseconds per
step (count × time, summed), their TFLOP/s and share of the GPU's dense bf16 peak, and the ratio to the baseline,
all measured in this run. ``--out`` writes one row per distinct call (its count, GFLOP and milliseconds in each
setting) and a ``TOTAL`` row per experiment.

What it leaves out: everything but the convolutions (normalisation, attention, the optimizer; their share is the
step's time less the total here), and the layout conversions between a convolution and the operators around it (a
compiled step in channels-last keeps its tensors NDHWC: ``voxdiff.models.unet.apply_channels_last``). The calls run
one after another with their operands warm in the GPU's cache where they fit; in the step they follow other
kernels.

On a machine without a CUDA GPU it runs each experiment tiny (``bench_gpu_step.TINY``) in fp32 on the CPU, layouts
only (cuDNN's autotuner needs cuDNN), and says so: those figures say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import csv
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench_gpu_step import TINY, dense_peak, write_csv  # the bench folder is on the path when a script in it runs

SETTINGS = "NCDHW,NDHWC,NCDHW+autotune,NDHWC+autotune"


def parse_settings(text: str, cuda: bool) -> list[tuple[str, bool]]:
    """``NCDHW,NDHWC+autotune`` -> ``[("NCDHW", False), ("NDHWC", True)]``; on a CPU the autotuned ones are
    dropped (said on stderr).

    Raises:
        SystemExit: a setting that names no layout of ``voxdiff.benchmarks.convs.LAYOUTS``.
    """
    from voxdiff.benchmarks.convs import LAYOUTS

    settings = []
    for item in (s.strip() for s in text.split(",") if s.strip()):
        layout, _, tune = item.partition("+")
        if layout not in LAYOUTS or tune not in ("", "autotune"):
            raise SystemExit(f"bench_convs: --settings {item!r}: use LAYOUT or LAYOUT+autotune, LAYOUT one of "
                             f"{sorted(LAYOUTS)}")
        if tune and not cuda:
            print(f"bench_convs: {item} left out: cuDNN's autotuner needs a CUDA GPU", file=sys.stderr)
            continue
        settings.append((layout, bool(tune)))
    if not settings:
        raise SystemExit(f"bench_convs: --settings {text!r} leaves nothing to time here")
    return settings


def setting_name(setting: tuple[str, bool]) -> str:
    return setting[0] + ("+autotune" if setting[1] else "")


def bench(name: str, overrides: list[str], device: str, settings: list[tuple[str, bool]], warmup: int, reps: int,
          rounds: int, top: int) -> list[dict[str, Any]]:
    """One experiment: its rows (one per distinct call, then ``TOTAL``), its table printed."""
    import torch

    from voxdiff.benchmarks.convs import step_convolutions, time_convolution
    from voxdiff.benchmarks.measure import experiment_on

    cuda = device == "cuda"
    with tempfile.TemporaryDirectory() as out:
        _, run = experiment_on(name, device, [*([] if cuda else TINY), *overrides, f"paths.output_dir={out}"])
    dtype = run.precision.autocast_dtype or torch.float32
    calls, cost = step_convolutions(run)
    step_tflop = cost.tflop
    gpu = torch.cuda.get_device_name() if cuda else "CPU"
    rows: list[dict[str, Any]] = []
    for call, count in calls.items():
        row: dict[str, Any] = {"experiment": name, "batch": run.batch_size, "device": gpu,
                               "dtype": str(dtype).removeprefix("torch."), "call": call.label, "count": count,
                               "gflop": round(call.flop / 1e9, 4)}
        for setting in settings:
            seconds = time_convolution(call, device, dtype, setting[0], autotune=setting[1], warmup=warmup,
                                       reps=reps, rounds=rounds)
            row[f"ms_{setting_name(setting)}"] = round(seconds * 1e3, 4)
        rows.append(row)
        if cuda:
            torch.cuda.empty_cache()
    base = f"ms_{setting_name(settings[0])}"
    conv_tflop = sum(r["gflop"] * r["count"] for r in rows) / 1e3
    total: dict[str, Any] = {"experiment": name, "batch": run.batch_size, "device": gpu, "dtype": rows[0]["dtype"],
                             "call": "TOTAL", "count": sum(r["count"] for r in rows),
                             "gflop": round(conv_tflop * 1e3, 4)}
    for setting in settings:
        key = f"ms_{setting_name(setting)}"
        total[key] = round(sum(r[key] * r["count"] for r in rows), 3)
    peak = dense_peak(gpu) if cuda else None
    print(f"\n{name} at batch {run.batch_size} ({' '.join(overrides) or 'its defaults'}): {total['count']} convolution "
          f"calls a step, {len(rows)} distinct; {conv_tflop:.3f} of the step's {step_tflop:.3f} TFLOP "
          f"({conv_tflop / step_tflop:.1%}); {rows[0]['dtype']}")
    width = max(len(r["call"]) for r in rows)
    print(f"  {'calls taking the most time in ' + settings[0][0]:<{width}}  count  GFLOP  "
          + "  ".join(f"{setting_name(s):>15}" for s in settings) + "   (ms each)")
    for r in sorted(rows, key=lambda r: -r[base] * r["count"])[:top]:
        print(f"  {r['call']:<{width}}  {r['count']:>5}  {r['gflop']:>5.1f}  "
              + "  ".join(f"{r[f'ms_{setting_name(s)}']:>15.3f}" for s in settings))
    for setting in settings:
        key = f"ms_{setting_name(setting)}"
        ms = total[key]
        rate = conv_tflop / (ms / 1e3) if ms else float("nan")
        share = f", {rate / peak:.1%} of the dense bf16 peak" if peak else ""
        print(f"  {setting_name(setting):>15}: {ms:9.2f} ms of convolutions a step, {rate:7.1f} TFLOP/s{share}; "
              f"{ms / total[base]:.3f}x {settings[0][0]}'s")
    return [*rows, total]


def parser() -> argparse.ArgumentParser:
    """The command line (``tests/benchmarks/test_gpu_plans.py`` reads a plan's lines with it)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experiments", default="exp11", help="comma-separated experiment names")
    p.add_argument("--settings", default=SETTINGS, help=f"comma-separated (default {SETTINGS}); the first is the "
                                                         "baseline of the ratios")
    p.add_argument("--warmup", type=int, default=2, help="untimed runs of each call per setting (autotuning)")
    p.add_argument("--reps", type=int, default=5, help="runs per timed round")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds (their median)")
    p.add_argument("--top", type=int, default=12, help="calls printed per experiment")
    p.add_argument("--out", help="write the rows as CSV here (after each experiment)")
    p.add_argument("--append", action="store_true", help="keep the rows already in --out")
    p.add_argument("overrides", nargs="*", help="train.py overrides for every experiment")
    return p


def main() -> None:
    args = parser().parse_args()

    import torch

    from voxdiff.benchmarks.measure import device_banner

    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(device_banner("bench_convs", device) + ("" if device == "cuda" else " (tiny, fp32: no GPU figures)"))
    settings = parse_settings(args.settings, device == "cuda")
    rows: list[dict[str, Any]] = []
    if args.append and args.out and Path(args.out).exists():
        with open(args.out, newline="") as fh:
            rows = list(csv.DictReader(fh))
    for name in (n.strip() for n in args.experiments.split(",") if n.strip()):
        rows += bench(name, args.overrides, device, settings, args.warmup, args.reps, args.rounds, args.top)
        if args.out:
            write_csv(args.out, rows)


if __name__ == "__main__":
    main()
