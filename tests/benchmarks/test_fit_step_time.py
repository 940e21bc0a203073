"""``bench/fit_step_time.py``: the documented command that fits the preflight's time model runs, and the constants in
``STEP_THROUGHPUT`` are the ones it fits to ``reference/h100_step_times.csv`` (the plain loops) and to voxdiff's
own CUDA-graph step measured by ``bench/bench_gpu_step.py`` (``reference/h100_bench_gpu_step_v3.csv``, ``_v4.csv``, ``_v5.csv``)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from voxdiff.preflight.resources import STEP_THROUGHPUT

ROOT = Path(__file__).resolve().parents[2]


def test_the_fit_runs_and_reproduces_the_constants_in_the_code(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "fit_step_time.py"),
                          "--check", str(tmp_path / "none.csv")],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    for kind in ("eager", "compiled", "cudagraphs"):
        m = re.search(rf"^{kind}: tflops=([\d.]+) op_us=([\d.]+)$", out.stdout, re.M)
        assert m is not None, out.stdout
        table = STEP_THROUGHPUT[("H100", kind)]
        assert float(m.group(1)) == pytest.approx(table.tflops, rel=0.01)
        assert float(m.group(2)) == pytest.approx(table.op_us, rel=0.01)
    # each shape of each kind is printed with its error and its leave-one-out error
    assert len(re.findall(r"leave-one-out", out.stdout)) >= 16
