"""A run stopped in the middle (SIGKILL, SIGTERM) keeps its logged metrics, and its resume continues them.

A real ``python train.py`` process on a tiny config, held (``HoldAtStep``) two steps after its ``last.ckpt`` was
written, then killed (SIGKILL: no Python code runs) or terminated (SIGTERM: the run saves and stops).
Lightning writes the CSV after every logged step, so the steps logged before the stop are on disk; its own
CSVLogger then deleted them when the run resumed into the same folder, which ``ContinuingCSVLogger`` does not.
"""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from voxdiff.lightning.callbacks import HoldAtStep

REPO = Path(__file__).resolve().parents[2]
HOLD, EVERY, MAX = 8, 3, 12  # hold at step 8; last.ckpt every 3 steps: the last one before the hold is step 6

TINY = ["experiment=demo", "logger=csv", "data.volume_shape=[16,16,16]", "data.num_subjects=3",
        "model.channels=[8,8,8]", "model.num_res_blocks=1", "model.num_head_channels=8", "model.norm_num_groups=4",
        "trainer.accelerator=cpu", f"trainer.max_steps={MAX}", "trainer.log_every_n_steps=1",
        "trainer.check_val_every_n_epoch=1000", "trainer.num_sanity_val_steps=0", "trainer.enable_progress_bar=false",
        "trainer.enable_model_summary=false", "callbacks.progress_bar=null", "system.sampling.final=false",
        f"callbacks.last.every_n_train_steps={EVERY}"]


def _logged_steps(run_dir: Path) -> list[int]:
    files = sorted((run_dir / "csv").rglob("metrics.csv"))
    assert len(files) == 1, f"expected one metrics file under {run_dir / 'csv'}, found {files}"
    with files[0].open() as f:
        return [int(row["step"]) for row in csv.DictReader(f) if row.get("train/loss")]


def _train_py(tmp_path: Path, *extra: str) -> subprocess.Popen:
    run_dir, release = tmp_path / "run", tmp_path / "release"
    args = [*TINY, f"paths.run_dir={run_dir}", "+callbacks.hold._target_=voxdiff.lightning.callbacks.HoldAtStep",
            f"+callbacks.hold.at_step={HOLD}", f"+callbacks.hold.release_file={release}", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    return subprocess.Popen([sys.executable, str(REPO / "train.py"), *args], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_held(proc: subprocess.Popen, tmp_path: Path) -> None:
    held = tmp_path / "release.held"
    deadline = time.monotonic() + 180
    while not held.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the run never reached the hold at step {HOLD}:\n{proc.communicate()[0]}")
        time.sleep(0.1)


def _step(ckpt: Path) -> int:
    return int(torch.load(ckpt, map_location="cpu", weights_only=True)["global_step"])


@pytest.mark.parametrize("sig,saved", [(signal.SIGKILL, 6), (signal.SIGTERM, HOLD + 1)], ids=["SIGKILL", "SIGTERM"])
def test_a_stopped_run_keeps_its_metrics_and_its_resume_continues_them(tmp_path, sig, saved):
    """SIGKILL: the periodic last.ckpt (step 6) is the resume point, and the metrics of steps 0..7 are on disk.
    SIGTERM: the batch in flight ends, the run saves at the signal (step 9), exits 143, and steps 0..8 are on disk.
    Either way the resume continues the same file."""
    proc = _train_py(tmp_path)
    _wait_held(proc, tmp_path)
    proc.send_signal(sig)
    out = proc.communicate(timeout=60)[0]
    run_dir = tmp_path / "run"
    assert proc.returncode == (-9 if sig == signal.SIGKILL else 143), out
    assert _step(run_dir / "checkpoints" / "last.ckpt") == saved, out
    # the batch that makes step k is logged as step k-1: the last batch that ran made step `saved` or 8
    assert _logged_steps(run_dir) == list(range(max(saved, HOLD))), out
    (tmp_path / "release").touch()
    resumed = _train_py(tmp_path, "ckpt_path=auto")
    out = resumed.communicate(timeout=300)[0]
    assert resumed.returncode == 0, out
    assert "resuming from" in out and f"(step {saved})" in out, out
    assert _step(run_dir / "checkpoints" / "last.ckpt") == MAX
    # one file, each step once: after SIGKILL the resumed run redoes steps 6 and 7 and replaces their rows
    assert _logged_steps(run_dir) == list(range(MAX)), out


def test_hold_at_step_waits_for_its_file_and_stops_on_sigterm(tmp_path):
    release = tmp_path / "go"
    trainer = SimpleNamespace(global_step=2, received_sigterm=False)
    cb = HoldAtStep(at_step=3, release_file=release, timeout_s=0.3)
    cb.on_train_batch_start(trainer, None, None, 0)  # not its step: returns at once
    assert not cb.held_file.exists()
    trainer.global_step = 3
    with pytest.raises(TimeoutError, match="held at step 3"):
        cb.on_train_batch_start(trainer, None, None, 0)
    assert cb.held_file.read_text().startswith("3 ")
    trainer.received_sigterm = True
    cb.on_train_batch_start(trainer, None, None, 0)  # a SIGTERM ends the hold: Lightning stops at the batch end
    release.touch()
    trainer.received_sigterm = False
    cb.on_train_batch_start(trainer, None, None, 0)  # released: a resumed run does not hold again
    with pytest.raises(ValueError):
        HoldAtStep(at_step=-1, release_file=release)
