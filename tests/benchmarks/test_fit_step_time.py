"""``bench/fit_step_time.py``: the documented command that fits the preflight's time model runs, and the constants in
``STEP_THROUGHPUT`` are the ones it fits to ``reference/h100_step_times.csv`` (the plain loops) and to voxdiff's
own CUDA-graph step measured by ``bench/bench_gpu_step.py`` (``reference/h100_bench_gpu_step_v3.csv`` to
``_v6.csv``)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from script_modules import load_script

from voxdiff.preflight.resources import STEP_THROUGHPUT

ROOT = Path(__file__).resolve().parents[2]


def _timed_runs(tmp_path: Path, tiny_demo) -> tuple[Path, Path, float]:
    """Two train.py runs' measured.json: one as this CPU wrote it (no GPU: left out), one as a GPU run writes it
    (the same run, its device and GPU type those of an H100 run, its config a GPU run's), whose measured step is the
    preflight's prediction for that config, as train.py gives it to MeasuredRun (the GPU's step and the wait for the
    phantom's batches, loaded between steps without workers): the time model's error on it must come out as zero,
    which it does only if the config recorded resolves to the step the preflight predicted."""
    import json

    from voxdiff.cli.train import train
    from voxdiff.config import compose
    from voxdiff.preflight.check import run_preflight

    cpu = tmp_path / "cpu_run"
    train(compose("train", [*tiny_demo, f"paths.output_dir={cpu}", "trainer.max_steps=5"]))
    record = json.loads((cpu / "measured.json").read_text())
    assert record["device"] == "cpu" and record["step_time"]["steps"] == 2 and record["gpu"] is None
    assert record["predicted_step"] is None  # the CPU's step time is not predicted, nor its parts
    gpu_cfg = dict(record["config"], trainer={**record["config"]["trainer"], "accelerator": "gpu", "devices": 1})
    from omegaconf import OmegaConf

    predicted_ms = run_preflight(OmegaConf.create(gpu_cfg), suggest=False).needs.wall_step_s * 1e3
    gpu = tmp_path / "gpu_run"
    gpu.mkdir()
    record.update(device="cuda:0", device_name="NVIDIA H100 80GB HBM3", gpu="H100", config=gpu_cfg)
    record["step_time"].update(measured_ms=predicted_ms)
    (gpu / "measured.json").write_text(json.dumps(record))
    return cpu, gpu, predicted_ms


def test_the_fit_runs_and_reproduces_the_constants_in_the_code(tmp_path, tiny_demo):
    cpu, gpu, predicted_ms = _timed_runs(tmp_path, tiny_demo)
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "fit_step_time.py"),
                          "--check", str(tmp_path / "none.csv"), "--runs", str(cpu), str(gpu)],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    # --runs: the GPU run recounted as the preflight counts it, the CPU one left out
    assert "runs: 1 of 2 timed on a CUDA GPU" in out.stdout and f"{cpu / 'measured.json'}: no step timed" in out.stderr
    line = next(ln for ln in out.stdout.splitlines() if ln.strip().startswith("gpu_run (batch "))
    assert f"measured {predicted_ms:7.1f} ms" in line and line.endswith("STEP_THROUGHPUT  +0.0%"), line
    number = r"([\d.]+)"
    graphs = rf"tflops={number} op_us={number} conv_weight_gbps={number} tensor_gbps={number}"
    assert re.search(rf"^\(H100, cudagraphs\) with the runs: {graphs} \(11 rows \+ 1 runs\)", out.stdout,
                     re.M), out.stdout
    for kind in ("eager", "compiled", "cudagraphs"):
        held = r" \(the FLOP rate held at or under the dense bf16 peak, 989.4 TFLOP/s\)"
        m = re.search(rf"^{kind}: " + (graphs + held if kind == "cudagraphs" else rf"tflops={number} op_us={number}")
                      + "$", out.stdout, re.M)
        assert m is not None, out.stdout
        table = STEP_THROUGHPUT[("H100", kind)]
        assert float(m.group(1)) == pytest.approx(table.tflops, rel=0.01)
        assert float(m.group(2)) == pytest.approx(table.op_us, rel=0.01)
        if kind == "cudagraphs":
            assert float(m.group(3)) * 1e9 == pytest.approx(table.conv_weight_rate, rel=0.01)
            assert float(m.group(4)) * 1e9 == pytest.approx(table.tensor_rate, rel=0.01)
    # each shape of each kind is printed with its error and its leave-one-out error (the CUDA-graph rows under both
    # models), and the four H200 rows under the H100's constants
    assert len(re.findall(r"leave-one-out", out.stdout)) >= 25
    h200 = out.stdout.split("H200 rows (not fitted)")[1].splitlines()[1:5]
    assert all(re.search(r"h200_bench_gpu_step(_v2)?\.csv\).* predicted +[+-][\d.]+%$", ln) for ln in h200), h200
    # and the four channels-last H200 rows (sessions 26 and 31), among them exp11 at batch 32 within 2%
    cl = out.stdout.split("H200 channels-last rows (not fitted)")[1].splitlines()[1:5]
    assert all(re.search(r"h200_bench_gpu_step_v[34]\.csv\).* predicted +[+-][\d.]+%$", ln) for ln in cl), cl
    b32 = next(ln for ln in cl if ln.strip().startswith("F_e11_b32"))
    assert abs(float(b32.rsplit(" ", 1)[1].rstrip("%"))) < 2.0, b32


def test_the_four_term_fit_recovers_the_constants_that_made_its_points():
    """Step times made by a known Throughput from varied costs come back as that Throughput, and a term the times
    do not depend on is fitted to zero (its rate None)."""
    import random

    from voxdiff.preflight.resources import H100_BANDWIDTH, StepCost, Throughput

    fit_step_time = load_script("bench/fit_step_time.py")
    truth = Throughput(800.0, 10.0, "test", H100_BANDWIDTH, conv_weight_rate=300e9, tensor_rate=2000e9)
    rng = random.Random(0)
    costs = [StepCost(rng.uniform(1, 200), rng.randint(500, 1500), conv_weight_bytes=rng.randint(10**9, 3 * 10**10),
                      tensor_bytes=rng.randint(10**10, 10**12)) for _ in range(8)]
    got = fit_step_time.fit_four([(c, truth.seconds(c)) for c in costs])
    assert (got.tflops, got.op_us) == (pytest.approx(800.0), pytest.approx(10.0))
    assert (got.conv_weight_rate, got.tensor_rate) == (pytest.approx(300e9), pytest.approx(2000e9))
    no_tensor = Throughput(800.0, 10.0, "test", H100_BANDWIDTH, conv_weight_rate=300e9)
    got = fit_step_time.fit_four([(c, no_tensor.seconds(c)) for c in costs])
    assert got.tensor_rate is None and got.conv_weight_rate == pytest.approx(300e9)


def test_the_four_term_fit_holds_the_flop_rate_at_the_dense_peak():
    """Times made with a FLOP rate above the GPU's peak (as an unbounded fit of session 25's rows came out, 1058
    TFLOP/s against an H100's 989.4) fit that rate when unbounded and the peak itself when bounded, the other terms
    taking up the rest; a bound the data do not reach changes nothing."""
    import random

    from voxdiff.preflight.resources import H100_BANDWIDTH, StepCost, Throughput

    fit_step_time = load_script("bench/fit_step_time.py")
    too_fast = Throughput(1100.0, 10.0, "test", H100_BANDWIDTH, conv_weight_rate=300e9, tensor_rate=2000e9)
    rng = random.Random(1)
    costs = [StepCost(rng.uniform(1, 200), rng.randint(500, 1500), conv_weight_bytes=rng.randint(10**9, 3 * 10**10),
                      tensor_bytes=rng.randint(10**10, 10**12)) for _ in range(8)]
    points = [(c, too_fast.seconds(c)) for c in costs]
    assert fit_step_time.fit_four(points).tflops == pytest.approx(1100.0)
    bounded = fit_step_time.fit_four(points, peak_tflops=989.4)
    assert bounded.tflops == pytest.approx(989.4)
    errors = [gpu / t - 1 for gpu, t in ((bounded.seconds(c), t) for c, t in points)]
    assert max(map(abs, errors)) < 0.1, errors  # the rest is taken up by the other terms, not dropped
    assert fit_step_time.fit_four(points, peak_tflops=2000.0).tflops == pytest.approx(1100.0)
