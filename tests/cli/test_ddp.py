"""DDP on the CPU: two processes (gloo) train through the real train.py and keep identical weights."""

import json
import subprocess
import sys

import pytest


TINY = ["experiment=demo", "data.volume_shape=[16,32,32]", "data.num_subjects=4", "model.channels=[8,16,16]",
        "model.norm_num_groups=8", "model.num_head_channels=8", "logger=csv", "system.sampling.every_n_epochs=0",
        "system.sampling.final=false"]


@pytest.mark.slow
@pytest.mark.parametrize("compiled", [["data.covariates=[age,sex]"],
                                      ["model.compile=true", "model.compile_backend=aot_eager"]],
                         ids=["eager-covariates", "compiled"])
def test_two_gloo_processes_keep_identical_replicas(repo, tmp_path, compiled):
    """Eager with the phantom's covariates (their embedding's gradients are all-reduced like the UNet's), and with
    the training forward compiled (model.compile): DDP's gradient hooks see the compiled backward."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "train.py", *TINY, "trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2",
           "trainer.precision=32-true", "trainer.max_steps=4", f"paths.run_dir={run_dir}",
           "+callbacks.replicas._target_=voxdiff.lightning.distributed.ReplicaConsistency", *compiled]
    env = {"OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "PATH": "/usr/bin:/bin"}
    result = subprocess.run(cmd, cwd=repo, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((run_dir / "replicas.json").read_text())
    assert report["world_size"] == 2 and report["global_step"] == 4
    first, second = report["checksums"]
    assert first == second  # all-reduced gradients: bit-identical replicas
    assert first != [0.0, 0.0]
    if "model.compile=true" in compiled:
        assert "compiled the training step in" in result.stdout + result.stderr


@pytest.mark.slow
def test_rank_0_out_of_memory_ends_the_processes_it_launched(repo, tmp_path):
    """Without Slurm or torchrun Lightning launches rank 1 from rank 0's process. When rank 0 fails (here the
    allocator's failure at step 2, on rank 0 only), rank 1 waits for it in a collective: with NCCL until the process
    group's timeout, holding its GPU; with gloo until rank 0's exit closes its sockets, then with a "Connection closed
    by peer" traceback. train.py ends it, says so, and exits with rank 0's code and report."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "train.py", *TINY, "trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2",
           "trainer.precision=32-true", "trainer.max_steps=6", f"paths.run_dir={run_dir}",
           "+callbacks.oom._target_=voxdiff.lightning.ExhaustMemory", "+callbacks.oom.at_step=2",
           "+callbacks.oom.rank=0"]
    env = {"OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "PATH": "/usr/bin:/bin"}
    result = subprocess.run(cmd, cwd=repo, capture_output=True, text=True, timeout=600, env=env)
    out = result.stdout + result.stderr
    assert result.returncode == 7, out[-3000:]
    assert ("[voxdiff] rank 0 failed; the processes it launched: local rank 1 killed after 3 s (it was waiting for "
            "this one in a collective)") in out
    assert "Connection closed by peer" not in out
    assert "CUDA out of memory in training at global step 2" in out
    assert (run_dir / "memory_error.json").is_file() and not (run_dir / "memory_error.rank1.json").exists()
