"""The SLURM path against a real Slurm: slurm/exp11.slurm, unchanged, submitted with sbatch.

CPU-sized overrides reach the job through the environment (VOXDIFF_OVERRIDES), as the job script documents; the
run root is a temporary folder. The cluster (slurmctld + slurmd) is started here and stopped by PID at the end.
"""

from __future__ import annotations

import csv
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from harness import (  # noqa: E402  (tests/slurm is on sys.path via conftest)
    EXP11,
    REPO,
    checkpoint_step,
    exp11_run_dir,
    job_log,
    running_cluster,
    submit_exp11,
)

pytestmark = [pytest.mark.slurm]

# exp11's 5-level UNet, shrunk to CPU size: 32³ phantom -> S2D 16×16³ (divisible by 2^4), 8..16 channels
TINY = ("trainer=cpu logger=csv data.volume_shape=[32,32,32] data.num_subjects=4 "
        "model.channels=[8,8,16,16,16] model.norm_num_groups=8 model.num_head_channels=8 model.num_res_blocks=1 "
        "trainer.check_val_every_n_epoch=1000 system.sampling.every_n_epochs=0 system.sampling.final=false")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with running_cluster(tmp_path_factory.mktemp("slurm")) as c:
        yield c


def test_script_is_rendered_from_site_config():
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "render_slurm.py"), "--check"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    text = EXP11.read_text()
    for directive in ("--gres=gpu:1", "--signal=USR1@", "--requeue", "--partition=gpu"):
        assert directive in text


def _logged_steps(run_dir: Path) -> list[int]:
    files = sorted((run_dir / "csv").rglob("metrics.csv"))
    assert len(files) == 1, f"the requeued job must continue the same logger run: {files}"
    with files[0].open() as f:
        return [int(row["step"]) for row in csv.DictReader(f) if row.get("train/loss")]


def test_requeued_job_resumes_from_its_checkpoint(cluster, tmp_path):
    """The exp11 job runs the preflight (with the site's GPU type), trains, is requeued and completes with its
    checkpoint. Requeued at a step the test controls: the job holds at step 8 (HoldAtStep) until the requeue has
    been sent, whatever the machine's speed (its periodic last.ckpt is then at step 6). The requeue's SIGTERM ends
    the hold; the batch in flight finishes and the run saves its resume checkpoint at step 9, having logged steps
    0..8. The run is conditioned on the phantom's covariates (age, sex): the requeued start resumes with the
    encoding its model learned (a resume that would encode them otherwise is refused), and the checkpoint keeps it."""
    max_steps, every, hold = 12, 3, 8
    release = tmp_path / "release"
    job = submit_exp11(cluster, tmp_path, f"{TINY} data.covariates=[age,sex] trainer.max_steps={max_steps} "
                       f"callbacks.last.every_n_train_steps={every} "
                       "trainer.log_every_n_steps=1 +callbacks.hold._target_=voxdiff.lightning.callbacks.HoldAtStep "
                       f"+callbacks.hold.at_step={hold} +callbacks.hold.release_file={release}")
    run_dir = exp11_run_dir(tmp_path, job)
    last = run_dir / "checkpoints" / "last.ckpt"
    cluster.wait_for_file(job, release.with_name("release.held"), log=lambda: job_log(job))
    assert cluster.job(job)["JobState"] == "RUNNING"
    assert checkpoint_step(last) == 6
    cluster.run("scontrol", "requeue", str(job))
    # Slurm holds a requeued job for ~2 minutes (BeginTime); once it is pending again, release it, as an admin would
    cluster.wait(job, {"PENDING"}, timeout=60, poll=0.2)
    assert checkpoint_step(last) == hold + 1  # saved at the signal
    assert _logged_steps(run_dir) == list(range(hold + 1)), job_log(job)  # the first half's metrics are on disk
    release.touch()  # the resumed run passes step 8 without holding
    cluster.release_requeued(job)
    info = cluster.wait(job, timeout=600)
    log = job_log(job)
    assert info["JobState"] == "COMPLETED", log
    assert "preflight" in log.lower()
    assert "++preflight.gpu=H100" in log  # site.env's GPU_TYPE, passed to preflight.py and train.py
    assert int(info["Restarts"]) == 1
    assert "(restart 1)" in log
    # the preflight ran at the first start only; the requeued start went straight to train.py (which checks again)
    assert log.count("configurations valid and fit") == 1, log
    assert "restart 1: the preflight passed at the first start" in log
    resumed = re.findall(r"resuming from .*?step (\d+)", log, flags=re.IGNORECASE)
    assert resumed and int(resumed[-1]) == hold + 1, log
    assert checkpoint_step(last) == max_steps  # the step count continued to the end, not restarted
    # both halves in one file, each step once: 0..8 of the first run, 9..11 of the requeued one
    assert _logged_steps(run_dir) == list(range(max_steps)), log
    encoding = torch.load(last, map_location="cpu", weights_only=True)["hyper_parameters"]["covariates"]
    assert [c["name"] for c in encoding["columns"]] == ["age", "sex"], encoding


def test_invalid_config_fails_fast_with_preflight_message(cluster, tmp_path):
    t0 = time.monotonic()
    job = submit_exp11(cluster, tmp_path, f"{TINY} data.volume_shape=[161,128,128]")
    info = cluster.wait(job, timeout=120)
    log = job_log(job)
    assert info["JobState"] == "FAILED", log
    assert "data.volume_shape=[161, 128, 128]" in log and "not divisible" in log
    assert "nothing was trained" in log
    assert not (exp11_run_dir(tmp_path, job) / "checkpoints").exists()
    assert time.monotonic() - t0 < 60
