"""SIGTERM in a real Slurm job (slurm/exp11.slurm, unchanged): ``scancel`` of a running job saves a resume
checkpoint and leaves the job cancelled; a SIGTERM that does not end the job (``scancel --signal=TERM``, what a
preemption's grace period delivers) saves, requeues the job as SIGUSR1 does, and the requeued job resumes from that
checkpoint to the end. The cluster is tests/slurm/harness.py's, on ports of its own (another test cluster may run beside).
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest

from harness import (  # noqa: E402  (tests/slurm is on sys.path via conftest)
    SlurmCluster,
    checkpoint_step,
    exp11_run_dir,
    job_log,
    running_cluster,
    submit_exp11,
)

pytestmark = [pytest.mark.slurm]

# exp11's 5-level UNet at CPU size (32³ phantom → S2D 16×16³), no validation: the steps are what matters here
TINY = ("trainer=cpu logger=csv data.volume_shape=[32,32,32] data.num_subjects=4 "
        "model.channels=[8,8,16,16,16] model.norm_num_groups=8 model.num_head_channels=8 model.num_res_blocks=1 "
        "trainer.check_val_every_n_epoch=1000 system.sampling.every_n_epochs=0 system.sampling.final=false "
        "callbacks.last.every_n_train_steps=2")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    # ports of its own (job ids are unique per cluster: harness.SlurmCluster.first_job_id)
    with running_cluster(tmp_path_factory.mktemp("slurm_scancel"), port=20000 + os.getpid() % 20000) as c:
        yield c


def _last(run_root: Path, job: int) -> Path:
    return exp11_run_dir(run_root, job) / "checkpoints" / "last.ckpt"


def _wait_training(cluster: SlurmCluster, job: int, last: Path, timeout: float = 300.0) -> None:
    """Until the job's first periodic checkpoint exists (training is under way)."""
    deadline = time.monotonic() + timeout
    while not last.is_file():
        assert time.monotonic() < deadline, job_log(job)
        assert cluster.job(job)["JobState"] in ("PENDING", "CONFIGURING", "RUNNING"), job_log(job)
        time.sleep(0.3)


def test_scancel_saves_a_resume_checkpoint_and_the_job_stays_cancelled(cluster, tmp_path):
    job = submit_exp11(cluster, tmp_path, f"{TINY} trainer.max_steps=100000")
    last = _last(tmp_path, job)
    _wait_training(cluster, job, last)
    t_cancel = time.time()
    cluster.run("scancel", str(job))
    info = cluster.wait(job, timeout=120)
    time.sleep(1.0)  # the log's last lines
    log = job_log(job)
    assert info["JobState"] == "CANCELLED" and int(info["Restarts"]) == 0, log
    assert f"resume checkpoint saved to {last}" in log, log
    assert f"Slurm job {job} not requeued" in log
    assert last.stat().st_mtime >= t_cancel and checkpoint_step(last) >= 2
    saved = re.findall(r"stopped by SIGTERM after step (\d+)", log)
    assert saved and int(saved[-1]) == checkpoint_step(last)
    assert "Traceback" not in log


def test_a_sigterm_that_does_not_end_the_job_requeues_it_and_it_resumes(cluster, tmp_path):
    max_steps = 40
    job = submit_exp11(cluster, tmp_path, f"{TINY} trainer.max_steps={max_steps}")
    last = _last(tmp_path, job)
    _wait_training(cluster, job, last)
    cluster.run("scancel", "--signal=TERM", str(job))  # the steps get SIGTERM; Slurm keeps the job RUNNING
    cluster.wait(job, {"PENDING"}, timeout=120, poll=0.2)  # requeued by train.py itself
    # said before the requeue: Slurm may end the job step before train() reports (this test once lost both lines)
    saved = re.findall(r"stopped by SIGTERM after step (\d+): resume checkpoint saved to \S+; requeueing Slurm job "
                       rf"{job}", job_log(job))
    assert saved, job_log(job)
    # Slurm holds a requeued job for ~2 minutes (BeginTime); release it, as an admin would
    cluster.release_requeued(job)
    info = cluster.wait(job, timeout=600)
    log = job_log(job)
    assert info["JobState"] == "COMPLETED" and int(info["Restarts"]) == 1, log
    assert re.search(rf"resuming from \S*last\.ckpt \(step {saved[0]}\)", log), log
    assert checkpoint_step(last) == max_steps
