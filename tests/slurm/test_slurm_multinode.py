"""Two Slurm nodes on one machine: ``sbatch --nodes=2`` of the rendered ``slurm/exp11.slurm`` trains with DDP over
gloo across them, is requeued in the middle, and resumes on both nodes from the saved step.

Each ``slurmd`` runs as its own host (network namespace, hostname, /etc/hosts: see ``harness.SlurmCluster``), so
the job goes through what a cluster does: ``srun`` starts one task per node, Lightning's ``SLURMEnvironment``
takes ranks and the main address (``node1``) from Slurm, and gloo connects the two hosts over the bridge.

Run alone:  .venv/bin/python -m pytest -m multinode
"""

from __future__ import annotations

import json
import re

import pytest

from harness import (  # noqa: E402  (tests/slurm is on sys.path via conftest)
    checkpoint_step,
    exp11_run_dir,
    job_log,
    running_cluster,
    submit_exp11,
)

pytestmark = [pytest.mark.slurm, pytest.mark.multinode, pytest.mark.slow]

# exp11's 5-level UNet at CPU size under the DDP trainer the job adds for two nodes (accelerator and precision
# set for the CPU); the replica check compares the two ranks' weights at the end
TINY_DDP = ("trainer.accelerator=cpu trainer.precision=32-true logger=csv data.volume_shape=[32,32,32] "
            "data.num_subjects=4 model.channels=[8,8,16,16,16] model.norm_num_groups=8 model.num_head_channels=8 "
            "model.num_res_blocks=1 trainer.check_val_every_n_epoch=1000 trainer.num_sanity_val_steps=0 "
            "system.sampling.every_n_epochs=0 system.sampling.final=false trainer.log_every_n_steps=1 "
            "+callbacks.replicas._target_=voxdiff.lightning.distributed.ReplicaConsistency")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with running_cluster(tmp_path_factory.mktemp("slurm2"), nodes=2, gpus=1, port=16827) as c:
        yield c


def test_two_node_job_requeued_mid_run_resumes_on_both_nodes(cluster, tmp_path):
    max_steps, every, hold = 10, 3, 8
    release = tmp_path / "release"
    overrides = (f"{TINY_DDP} trainer.max_steps={max_steps} callbacks.last.every_n_train_steps={every} "
                 "+callbacks.hold._target_=voxdiff.lightning.callbacks.HoldAtStep "
                 f"+callbacks.hold.at_step={hold} +callbacks.hold.release_file={release}")
    job = submit_exp11(cluster, tmp_path, overrides, "--nodes=2")
    run_dir = exp11_run_dir(tmp_path, job)
    cluster.wait_for_file(job, release.with_name("release.held"), log=lambda: job_log(job))
    info = cluster.job(job)
    assert info["JobState"] == "RUNNING" and info["NodeList"] == "node[1-2]", info
    assert checkpoint_step(run_dir / "checkpoints" / "last.ckpt") == 6
    cluster.run("scontrol", "requeue", str(job))
    cluster.wait(job, {"PENDING"}, timeout=90, poll=0.2)
    release.touch()
    cluster.release_requeued(job)
    info = cluster.wait(job, timeout=600)
    log = job_log(job)
    assert info["JobState"] == "COMPLETED", log
    assert int(info["Restarts"]) == 1
    second = log.split("(restart 1)", 1)[1]
    assert "trainer=ddp" in log.split("(restart 1)", 1)[0]  # job.sh chose DDP for two nodes
    # both ranks of the requeued job, one per node, resumed from the checkpoint saved at the signal (step 9)
    assert len(re.findall(r"resuming from \S+last\.ckpt \(step 9\)", second)) == 2, log
    assert sorted(re.findall(r"\(host (node\d), rank (\d),", second)) == [("node1", "0"), ("node2", "1")], log
    assert checkpoint_step(run_dir / "checkpoints" / "last.ckpt") == max_steps
    report = json.loads((run_dir / "replicas.json").read_text())
    assert report["world_size"] == 2 and report["global_step"] == max_steps
    first_rank, second_rank = report["checksums"]
    assert first_rank == second_rank  # all-reduced across the two hosts: identical replicas
