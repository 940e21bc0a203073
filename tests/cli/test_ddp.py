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
