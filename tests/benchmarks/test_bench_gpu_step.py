"""``bench/bench_gpu_step.py``'s rows from printed sides, and ``bench/gpu_sides.sh`` running a plan (one tiny side on
the CPU: what the script does on a GPU machine, end to end)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from script_modules import load_script

ROOT = Path(__file__).resolve().parents[2]


def test_rows_from_printed_sides_count_flops_from_whichever_plain_loop_ran(tmp_path):
    """A call that timed only the compiled plain loop beside voxdiff's step (as h100_bench_gpu_step_v4.csv) still
    gets TFLOP/s, the share of the dense peak and the ratio to the compiled loop; a side never printed is recorded."""
    log = tmp_path / "sides.log"
    compiled = {"ms_per_step": 100.0, "batch": 1, "tflop_per_step": 10.0}
    voxdiff = {"ms_per_step": 125.0, "batch": 1, "peak_gib": 4.0}
    log.write_text("bench_gpu_step: NVIDIA H100 80GB HBM3 (dense bf16 peak 989.4 TFLOP/s), torch x\n"
                   f"exp compiled: {json.dumps(compiled)}\nexp voxdiff: {json.dumps(voxdiff)}\n")
    out = tmp_path / "rows.csv"
    bench = load_script("bench/bench_gpu_step.py")
    bench.rows_from_log(str(log), str(out), append=False)
    (row,) = bench.read_csv(str(out))
    assert float(row["compiled_tflops"]) == pytest.approx(100.0)  # 10 TFLOP in 0.1 s
    assert float(row["voxdiff_tflops"]) == pytest.approx(80.0)
    assert float(row["voxdiff_peak_share"]) == pytest.approx(80.0 / 989.4)
    assert float(row["vs_compiled"]) == pytest.approx(0.8)
    assert "not in" in row["plain_error"] and "speedup" not in row


def test_rows_from_gpu_sides_results_count_flops_on_meta_at_each_sides_batch(tmp_path):
    """``gpu_sides.sh``'s results.txt (voxdiff sides only, as session 22's call) becomes one row per tag: the FLOPs of
    the tag's experiment at its own batch, counted on the meta device, give TFLOP/s and the share of the dense peak;
    a side cut off before its result (no ``::`` line) makes no row."""
    b1 = {"ms_per_step": 25.0, "batch": 1}
    b2 = {"ms_per_step": 40.0, "batch": 2}
    log = tmp_path / "results.txt"
    log.write_text("NVIDIA H200, 143771 MiB, 580.159.04\ntorch 2.11.0+cu130 monai 1.6.1 lightning 2.6.6\n"
                   "[t=21s] one voxdiff exp11 3 20\n"
                   f"one rc=0 wall=123s exp11 voxdiff  :: {json.dumps(b1)}\n"
                   f"two rc=0 wall=90s exp11 voxdiff data.batch_size=2 model.gradient_checkpointing=none :: "
                   f"{json.dumps(b2)}\n[t=540s] three voxdiff exp11 3 10 data.batch_size=4\n")
    out = tmp_path / "rows.csv"
    bench = load_script("bench/bench_gpu_step.py")
    bench.rows_from_log(str(log), str(out), append=False)
    one, two = bench.read_csv(str(out))
    assert (one["experiment"], two["experiment"], one["device"]) == ("one", "two", "NVIDIA H200")
    flop = float(one["tflop_per_step"])
    assert flop > 1 and float(two["tflop_per_step"]) == pytest.approx(2 * flop)  # counted at each side's batch
    assert float(one["voxdiff_tflops"]) == pytest.approx(flop / 0.025)
    assert float(two["voxdiff_peak_share"]) == pytest.approx(2 * flop / 0.040 / 989.4)
    assert float(two["voxdiff_samples_per_s"]) == pytest.approx(50.0)
    assert "meta" in one["tflop_source"] and "not in" in one["plain_error"]


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash runs the plan")
def test_gpu_sides_runs_a_plan_and_keeps_each_result(tmp_path):
    plan = tmp_path / "plan.txt"
    plan.write_text("# a shell line in the background, then one side alone, then one profiled\n"
                    "&!echo from-the-plan\nwait\nt1 plain exp11 1 1   # tiny on a CPU\nt2 voxdiff+profile exp11 1 1\n"
                    "t3 voxdiff+history exp11 1 1\n")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env.pop("OUT", None)
    done = subprocess.run(["bash", str(ROOT / "bench" / "gpu_sides.sh"), str(plan), str(tmp_path / "out")],
                          cwd=tmp_path, env={**env, "PYTHONPATH": str(ROOT / "src")}, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = (tmp_path / "out" / "results.txt").read_text().splitlines()
    (side,) = [ln for ln in lines if ln.startswith("t1 rc=0 ")]
    result = json.loads(side.split(" :: ", 1)[1])
    assert result["ms_per_step"] > 0 and result["batch"] == 1
    assert "from-the-plan" in lines and lines[-1].endswith("done")
    (profiled,) = [ln for ln in lines if ln.startswith("t2 rc=0 ")]
    assert " exp11 voxdiff " in profiled and "profiled_device_ms_per_step" in json.loads(profiled.split(" :: ", 1)[1])
    assert any(ln.startswith("t2 | ") and "Self CPU" in ln for ln in lines)  # its profiler's table
    (recorded,) = [ln for ln in lines if ln.startswith("t3 rc=0 ")]
    assert json.loads(recorded.split(" :: ", 1)[1])["history_grown_gib"] == {}  # a CPU's allocator records nothing
    assert "t3 | allocator history over the 1 warm-up steps (0 entries; none off a CUDA device):" in lines
    assert "t3 | segments reserved within the record: none; released 0.00 GiB" in lines
    assert not (tmp_path / "out" / "errors.txt").exists()


@pytest.mark.parametrize("overrides, start", [([], 0), (["system.ema.start_step=7"], 7)])
def test_the_voxdiff_side_times_the_ema_averaging_not_its_copy_phase(tmp_path, overrides, start):
    """With a GPU's defaults (``system.ema.start_step=1000``, forced here by ``VOXDIFF_TARGET=gpu``) a benchmark of a
    few steps would time the EMA copying the weights (8 bytes per parameter) instead of averaging them (12), as the
    rows before session 16 did: the voxdiff side sets ``start_step=0`` unless its overrides say otherwise, and says
    what it ran."""
    env = {**os.environ, "VOXDIFF_TARGET": "gpu", "PYTHONPATH": str(ROOT / "src")}
    job = {"side": "voxdiff", "name": "exp11", "overrides": overrides, "warmup": 1, "steps": 2}
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_gpu_step.py"), "--worker", json.dumps(job)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads([ln for ln in done.stdout.splitlines() if ln.startswith("{")][-1])
    assert result["step"].endswith(f"EMA every 10 from step {start}"), result["step"]  # decay 0.9999: auto is 10
    bench = load_script("bench/bench_gpu_step.py")
    assert bench.STEADY == ["system.ema.start_step=0"]


@pytest.mark.parametrize("side", ["plain", "voxdiff"])
@pytest.mark.parametrize("overrides, layout", [([], "NCDHW"), (["model.channels_last=true"], "NDHWC")])
def test_each_side_takes_the_channels_last_layout_it_is_given_and_says_so(tmp_path, side, overrides, layout):
    """``model.channels_last=true`` on a plain side lays its UNet out channels-last (it was ignored before session 25,
    so a plan's channels-last plain loop would have timed NCDHW), as on voxdiff's, and each side says which layout its
    convolution weights had after the timed steps (fused and foreach AdamW keep a parameter's layout): since
    ``model.channels_last=auto`` is channels-last on a GPU, a row says which it timed. Without the override,
    ``auto`` (the default) resolves as voxdiff's step would on this CPU: NCDHW."""
    job = {"side": side, "name": "exp11", "overrides": overrides, "warmup": 1, "steps": 1}
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_gpu_step.py"), "--worker", json.dumps(job)],
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT / "src")}, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads([ln for ln in done.stdout.splitlines() if ln.startswith("{")][-1])
    assert result["layout"] == layout and result["ms_per_step"] > 0
