"""SIGTERM to a real ``python train.py`` process: it saves a resume checkpoint (atomically) at the next batch
boundary, says so, exits 143, and the checkpoint resumes. The Slurm side (requeue, scancel) is in
tests/slurm/test_slurm_scancel.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from voxdiff.cli.exit_codes import EXIT_TERMINATED
from voxdiff.cli.train import train
from voxdiff.config import compose

REPO = Path(__file__).resolve().parents[2]


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.is_file():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"no {path} after {timeout} s"
        time.sleep(0.1)


def test_sigterm_saves_a_resume_checkpoint_and_exits_143(tiny_demo, tmp_path):
    run_dir = tmp_path / "run"
    long_run = [*tiny_demo, "trainer.max_steps=100000", "trainer.max_epochs=-1", "callbacks.last.every_n_train_steps=3"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    env.pop("SLURM_JOB_ID", None)
    proc = subprocess.Popen([sys.executable, str(REPO / "train.py"), *long_run, f"paths.run_dir={run_dir}"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    last = run_dir / "checkpoints" / "last.ckpt"
    try:
        _wait_for(last, proc)  # the periodic save at step 3: training is under way
        t_signal = time.time()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == EXIT_TERMINATED, err[-3000:]
    assert "Traceback" not in err
    assert f"resume checkpoint saved to {last}" in err
    assert f"ckpt_path=auto paths.run_dir={run_dir.resolve()}" in err
    assert last.stat().st_mtime >= t_signal  # written after the signal, not the periodic save
    assert not [p for p in last.parent.iterdir() if p.name.endswith(".tmp")]  # atomic: no temporary file left
    saved = torch.load(last, map_location="cpu", weights_only=True)
    step = saved["global_step"]
    assert step >= 3 and f"stopped by SIGTERM after step {step}" in err
    assert not (run_dir / ".voxdiff.lock").exists()  # the lock was given back

    # the checkpoint resumes: ckpt_path=auto finds it and training continues from its step
    report = train(compose("train", [*tiny_demo, f"trainer.max_steps={step + 2}", "trainer.max_epochs=-1",
                                     "callbacks.last.every_n_train_steps=3", f"paths.output_dir={run_dir}",
                                     "ckpt_path=auto"]))
    assert torch.load(report["last_checkpoint"], weights_only=True)["global_step"] == step + 2


def test_the_sigterm_handler_runs_no_collective(monkeypatch):
    """Lightning 2.6's SIGTERM handler broadcasts the flag from inside the handler (lightning#20825), wherever the
    main thread is, also inside another collective: a DDP run stopped by ``kill`` broke off with "Connection closed
    by peer" and hung (a suite run of tests/cli/test_ddp.py, session 22). With :class:`SaveOnSigterm` the trainer
    registers a handler that forwards the signal and sets the flag, and never calls a collective: the loop
    broadcasts rank 0's flag at the next batch, in order. Lightning's own handler, called the same way, does."""
    import lightning as L
    import torch.distributed as dist

    from voxdiff.lightning.preemption import SaveOnSigterm

    calls: list[str] = []
    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "broadcast", lambda *a, **k: calls.append("broadcast"))
    monkeypatch.setattr(L.Trainer, "world_size", property(lambda self: 2))

    def handler_after_setup(callbacks: list) -> tuple[L.Trainer, object]:
        trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                            enable_checkpointing=False, callbacks=callbacks)
        for cb in callbacks:
            cb.setup(trainer, None, "fit")
        return trainer, trainer._signal_connector._sigterm_notifier_fn  # what register_signal_handlers composes

    trainer, ours = handler_after_setup([SaveOnSigterm()])
    ours(signal.SIGTERM, None)
    assert trainer.received_sigterm and calls == []
    theirs_trainer, theirs = handler_after_setup([])
    theirs(signal.SIGTERM, None)
    assert theirs_trainer.received_sigterm and calls == ["broadcast"]  # what the replacement leaves out
