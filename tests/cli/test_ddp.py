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


def _out_of_memory_on_rank(repo, run_dir, rank: int) -> tuple[int, str]:
    """A two-process gloo run whose rank ``rank`` alone runs out of memory at step 2: its exit code and output."""
    cmd = [sys.executable, "train.py", *TINY, "trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2",
           "trainer.precision=32-true", "trainer.max_steps=6", f"paths.run_dir={run_dir}",
           "+callbacks.oom._target_=voxdiff.lightning.ExhaustMemory", "+callbacks.oom.at_step=2",
           f"+callbacks.oom.rank={rank}"]
    env = {"OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "PATH": "/usr/bin:/bin"}
    result = subprocess.run(cmd, cwd=repo, capture_output=True, text=True, timeout=600, env=env)
    return result.returncode, result.stdout + result.stderr


@pytest.mark.slow
def test_rank_0_out_of_memory_ends_the_processes_it_launched(repo, tmp_path):
    """Without Slurm or torchrun Lightning launches rank 1 from rank 0's process. When rank 0 fails (here the
    allocator's failure at step 2, on rank 0 only), rank 1 waits for it in a collective: with NCCL until the process
    group's timeout, holding its GPU; with gloo until rank 0's exit closes its sockets, then with a "Connection closed
    by peer" traceback. train.py ends it, says so, and exits with rank 0's code and report."""
    run_dir = tmp_path / "run"
    code, out = _out_of_memory_on_rank(repo, run_dir, 0)
    assert code == 7, out[-3000:]
    assert ("[voxdiff] rank 0 failed; the processes it launched: local rank 1 killed after 3 s (it was waiting for "
            "this one in a collective)") in out
    assert "Connection closed by peer" not in out
    assert "CUDA out of memory in training at global step 2" in out
    assert (run_dir / "memory_error.json").is_file() and not (run_dir / "memory_error.rank1.json").exists()


@pytest.mark.slow
def test_rank_1_out_of_memory_ends_the_run_with_its_code(repo, tmp_path):
    """When a process Lightning launched fails (here rank 1 runs out of memory at step 2), the run exits with its
    code and one line from each: Lightning's observer would have SIGKILLed every process (exit 137), or, with gloo,
    rank 0 would have ended first with a "Connection closed by peer" traceback (exit 1)."""
    run_dir = tmp_path / "run"
    code, out = _out_of_memory_on_rank(repo, run_dir, 1)
    assert code == 7, out[-3000:]
    assert "[voxdiff] out of memory: CUDA out of memory in training at global step 2" in out  # rank 1's own line
    assert "local rank 1 failed (exit code 7; its message is above)" in out
    assert "Traceback" not in out
    assert (run_dir / "memory_error.rank1.json").is_file() and not (run_dir / "memory_error.json").exists()


@pytest.mark.slow
def test_sigterm_to_rank_0_saves_a_resume_checkpoint_and_ends_both_ranks(repo, tmp_path):
    """`kill <pid>` of a two-process run without Slurm: Lightning forwards SIGTERM to rank 1, both stop at the next
    batch boundary and write the resume checkpoint together (rank 1 waits at its barrier while rank 0 writes), and
    the run exits 143 with last.ckpt, saying how rank 1 ended, with no failure reported. (Here rank 0's own handling
    stands the watch down before rank 1 has exited; the watch's standing by while a run is stopped, for a rank 0
    slower than that, is tested in tests/lightning/test_distributed.py.)"""
    import os
    import signal
    import time

    run_dir = tmp_path / "run"
    log = tmp_path / "log.txt"
    cmd = [sys.executable, "train.py", *TINY, "trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2",
           "trainer.precision=32-true", "trainer.max_steps=100000", f"paths.run_dir={run_dir}"]
    env = {"OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "PATH": "/usr/bin:/bin"}
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=repo, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            deadline = time.monotonic() + 300
            while "Epoch 3" not in log.read_text(errors="replace"):  # training, past the first validations
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.5)
            os.kill(proc.pid, signal.SIGTERM)
            code = proc.wait(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
    text = log.read_text(errors="replace")
    assert code == 143, text[-3000:]
    assert "[voxdiff] SIGTERM: stopped by SIGTERM after step" in text
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()
    assert "[voxdiff] rank 0 was interrupted; the processes it launched: local rank 1 ended (exit code 143)" in text
    assert "failed (exit code" not in text


@pytest.mark.slow
def test_a_non_finite_loss_stops_both_ranks_with_the_last_good_checkpoint(repo, tmp_path):
    """A NaN batch on the ranks at step 5 (the all-reduced gradients carry it to both): both stop there with exit 3,
    rank 0 after rank 1 ended by itself (its own failure, not one rank 0 followed), and the checkpoint left is one
    of finite weights from before the step."""
    import torch

    run_dir = tmp_path / "run"
    cmd = [sys.executable, "train.py", *TINY, "trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2",
           "trainer.precision=32-true", "trainer.max_steps=8", f"paths.run_dir={run_dir}",
           "+callbacks.poison._target_=voxdiff.lightning.callbacks.PoisonBatch", "+callbacks.poison.at_step=5"]
    env = {"OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "PATH": "/usr/bin:/bin"}
    result = subprocess.run(cmd, cwd=repo, capture_output=True, text=True, timeout=600, env=env)
    out = result.stdout + result.stderr
    assert result.returncode == 3, out[-3000:]
    assert "[voxdiff] rank 0 failed; the processes it launched: local rank 1 ended (exit code 3)" in out
    assert "the training loss is nan at global step 5" in out and "Traceback" not in out
    (ckpt,) = (run_dir / "checkpoints").glob("*.ckpt")
    state = torch.load(ckpt, map_location="cpu", weights_only=True)
    assert state["global_step"] <= 5
    assert all(torch.isfinite(v).all() for v in state["state_dict"].values() if v.is_floating_point())
    assert f"The last good checkpoint: {ckpt}" in out  # the best model's file is one (no last.ckpt before step 50)
