"""``bench/measure_sampling.py`` end to end on the CPU (predictions only): the system made ready as sample.py makes a
checkpoint ready, sampled at each batch and autoguidance scale, each printed with its prediction."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_bench_samples_each_setting_and_prints_its_prediction():
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "measure_sampling.py"), "--experiments", "demo",
                          "--batches", "1,2", "--autoguide", "1,1.25", "--steps", "2", "--device", "cpu",
                          "--history", "5", "data.volume_shape=[16,16,16]"],  # no history on the CPU
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {(r["batch"], r["autoguide_scale"]): r
            for r in (json.loads(ln) for ln in out.stdout.splitlines() if ln.startswith("{"))}
    assert set(rows) == {(1, 1.0), (2, 1.0), (1, 1.25), (2, 1.25)}
    assert all(r["steps"] == 2 and r["measured_gib"] is None for r in rows.values())  # no peak statistics here
    assert "alive together at their peak" not in out.stdout
    assert rows[(2, 1.0)]["predicted_gib"] > rows[(1, 1.0)]["predicted_gib"]  # more masks at once
    assert rows[(1, 1.25)]["predicted_gib"] > rows[(1, 1.0)]["predicted_gib"]  # the guide's UNet beside
