"""``bench/measure_reconstruction.py`` end to end on the CPU (predictions only): an untrained VQ-VAE reconstructs two
chunks of each batch through evaluate.py's loop, each printed with its prediction."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_bench_reconstructs_each_batch_and_prints_its_prediction():
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "measure_reconstruction.py"), "--experiments",
                          "vqvae_demo", "--batches", "1,2", "--device", "cpu", "data.volume_shape=[24,32,32]"],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {r["batch"]: r for r in (json.loads(ln) for ln in out.stdout.splitlines() if ln.startswith("{"))}
    assert set(rows) == {1, 2} and all(r["measured_gib"] is None for r in rows.values())  # no peak statistics here
    assert rows[2]["predicted_gib"] > rows[1]["predicted_gib"] > 0  # two volumes at once need more
    assert rows[1]["volume"] == [24, 32, 32]


def test_a_diffusion_experiment_is_refused():
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "measure_reconstruction.py"), "--experiments", "demo",
                          "--device", "cpu"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode != 0 and "is not a VQ-VAE stage 1" in out.stderr
