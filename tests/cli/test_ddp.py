"""DDP on the CPU: two processes (gloo) train through the real train.py and keep identical weights."""

import json
import subprocess
import sys

import pytest

from voxdiff.config import compose
from voxdiff.preflight.check import per_gpu_peak, run_preflight

TINY = ["experiment=demo", "data.volume_shape=[16,32,32]", "data.num_subjects=4", "model.channels=[8,16,16]",
        "model.norm_num_groups=8", "model.num_head_channels=8", "logger=csv", "system.sampling.every_n_epochs=0",
        "system.sampling.final=false"]


@pytest.mark.slow
@pytest.mark.parametrize("compiled", [[], ["model.compile=true", "model.compile_backend=aot_eager"]],
                         ids=["eager", "compiled"])
def test_two_gloo_processes_keep_identical_replicas(repo, tmp_path, compiled):
    """Also with the training forward compiled (model.compile): DDP's gradient hooks see the compiled backward."""
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
    if compiled:
        assert "compiled the training step in" in result.stdout + result.stderr


def test_ddp_config_takes_devices_and_nodes_from_slurm(monkeypatch):
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "4")
    monkeypatch.setenv("SLURM_NNODES", "2")
    cfg = compose("train", ["experiment=exp11", "trainer=ddp"])
    assert cfg.trainer.devices == 4 and cfg.trainer.num_nodes == 2 and cfg.trainer.strategy == "ddp"


def test_preflight_accounts_for_the_strategy():
    single = run_preflight(compose("preflight", ["experiment=exp9_ldm_8x_bravo"]), suggest=False)
    report = single.report
    ddp = per_gpu_peak(report, "ddp", 4)
    fsdp = per_gpu_peak(report, "fsdp", 4)
    assert ddp > report.peak_allocated  # DDP's gradient buckets: one more copy of the weights per GPU
    assert fsdp < 0.5 * report.peak_allocated  # the 2.7B model's states, sharded over 4 GPUs
    cfg = compose("preflight", ["experiment=exp9_ldm_8x_bravo", "trainer=fsdp", "trainer.devices=4"])
    result = run_preflight(cfg, suggest=False)
    assert (result.strategy, result.world_size) == ("fsdp", 4)
    assert result.per_gpu_peak_gib < single.per_gpu_peak_gib


def test_fsdp_config_builds_a_full_shard_strategy_wrapping_unet_blocks():
    from hydra.utils import instantiate
    from lightning.pytorch.strategies import FSDPStrategy
    from monai.networks.blocks.spatialattention import SpatialAttentionBlock
    from monai.networks.nets.diffusion_model_unet import DiffusionUNetResnetBlock

    strategy = instantiate(compose("train", ["experiment=exp11", "trainer=fsdp"]).trainer.strategy)
    assert isinstance(strategy, FSDPStrategy)
    assert strategy.sharding_strategy.name == "FULL_SHARD"
    assert set(strategy.kwargs["auto_wrap_policy"]._module_classes) == {DiffusionUNetResnetBlock, SpatialAttentionBlock}
