"""SIGTERM (``scancel``, a preemption without ``--signal``, ``kill``): save a resume checkpoint, then stop.

Lightning's SIGTERM handler forwards the signal to the processes its launcher started and sets a flag; the
training loop raises ``SIGTERMException`` at the next batch boundary (after the optimizer step and the
``on_train_batch_end`` hooks) — the checkpoint is written then, from the main loop, never inside the signal handler
(saving in a handler can hang: lightning#21406). With several processes the loop broadcasts rank 0's flag at the
start of every batch, so all ranks stop at the same one. Lightning 2.6's handler also broadcasts the flag from
inside the handler (lightning#20825): a collective that Python runs wherever the main thread is, also inside
another collective. Seen once here (a suite run of tests/cli/test_ddp.py): the handler's broadcast ran inside the
guard's all-reduce, gloo broke off with "Connection closed by peer", and the run did not exit.
:meth:`SaveOnSigterm.setup` puts back the handler without that broadcast (:func:`sigterm_notifier`).

Without this callback that exception is a ``SystemExit`` with status 0: the run ended silently with nothing saved
since the last periodic checkpoint.

:class:`SaveOnSigterm` writes ``checkpoints/last.ckpt`` (atomically, through the trainer's checkpoint IO) in
``on_exception``, so ``ckpt_path=auto`` resumes from it, and, in a Slurm job that is still running, requeues the
job as Lightning does on SIGUSR1, after saying what was saved (Slurm may end the step before ``train()`` reports).
A job that Slurm is already ending (``scancel``, time limit, a preemption that cancels) is not requeued:
``scontrol requeue`` would bring back a job its user cancelled. ``train()`` then reports what happened and exits
with ``EXIT_TERMINATED`` (143).
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.utilities.exceptions import SIGTERMException

from voxdiff.lightning.callbacks import LastCheckpoint


def slurm_job_id() -> str | None:
    """This process's Slurm job (``<array job>_<task>`` for an array task), or None outside a batch job."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    if not SLURMEnvironment.detect():
        return None
    array = os.environ.get("SLURM_ARRAY_JOB_ID")
    job = f"{array}_{os.environ['SLURM_ARRAY_TASK_ID']}" if array else os.environ.get("SLURM_JOB_ID")
    return job if job and re.fullmatch(r"[0-9_]+", job) else None


def requeue_slurm_job(job: str) -> str:
    """``scontrol requeue JOB`` if Slurm still reports the job RUNNING; returns what happened, in words."""
    try:
        shown = subprocess.run(["scontrol", "-o", "show", "job", job], capture_output=True, text=True, timeout=30)
        state = re.search(r"\bJobState=(\S+)", shown.stdout)
        state = state.group(1) if state else "unknown"
        if state != "RUNNING":
            return (f"Slurm job {job} not requeued: Slurm reports it {state} (cancelled, timed out or preempted); "
                    f"to continue, resubmit it or run scontrol requeue {job}")
        done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as err:
        return f"Slurm job {job} not requeued: {err}"
    if done.returncode != 0:
        return f"Slurm job {job} not requeued: scontrol requeue failed ({(done.stderr or done.stdout).strip()})"
    return f"Slurm job {job} requeued: it resumes from this checkpoint when it starts again"


def _resume_path(trainer: L.Trainer) -> Path:
    for cb in trainer.checkpoint_callbacks:
        if isinstance(cb, LastCheckpoint) and cb.dirpath:
            return Path(cb.dirpath) / f"{cb.CHECKPOINT_NAME_LAST}{cb.FILE_EXTENSION}"
    return Path(trainer.default_root_dir) / "checkpoints" / "last.ckpt"


def sigterm_notifier(trainer: L.Trainer) -> Callable[[int, Any], None]:
    """The SIGTERM handler Lightning registers first (``_SignalConnector._sigterm_notifier_fn``) without its
    collective: say so, forward the signal once to the processes the strategy's launcher started, set the flag the
    loop reads (and broadcasts from rank 0 at the next batch, in order with the other collectives)."""
    connector = trainer._signal_connector
    log = logging.getLogger("lightning.pytorch.trainer.connectors.signal_connector")

    def notify(signum: int, _frame: Any) -> None:
        log.info(f"[rank: {trainer.local_rank}] Received SIGTERM: {signum}")
        if not connector.received_sigterm:
            launcher = trainer.strategy.launcher
            if launcher is not None:
                launcher.kill(signum)
        connector.received_sigterm = True

    return notify


class SaveOnSigterm(L.Callback):
    """On SIGTERM: a resume checkpoint at the last finished step, and a requeue of a running Slurm job.

    After the exception, ``step``, ``saved`` (the checkpoint path, or None when no step had finished) and
    ``requeue`` (what happened to the Slurm job, or None outside Slurm) describe what was done.
    """

    def __init__(self) -> None:
        self.received = False
        self.step = 0
        self.saved: Path | None = None
        self.requeue: str | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # before the trainer registers its signal handlers (after the setup hooks): the one it composes first is
        # looked up on the connector, so this instance's replaces Lightning 2.6's, which broadcasts in the handler
        trainer._signal_connector._sigterm_notifier_fn = sigterm_notifier(trainer)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if not isinstance(exception, SIGTERMException):
            return
        self.received = True
        self.step = trainer.global_step
        if trainer.global_step > 0:  # nothing trained yet: nothing to save
            path = _resume_path(trainer)
            trainer.save_checkpoint(path)  # the trainer's checkpoint IO: atomic (AtomicCheckpointIO)
            self.saved = path
        job = slurm_job_id()
        if job is not None and trainer.is_global_zero:
            # Slurm ends this job step as soon as it requeues the job, possibly before train() reports: say what
            # was saved, and that the requeue follows, first
            print(f"[voxdiff] {self._stopped()}; requeueing Slurm job {job}", file=sys.stderr, flush=True)
            self.requeue = requeue_slurm_job(job)

    def _stopped(self) -> str:
        return f"stopped by SIGTERM after step {self.step}: " + (
            f"resume checkpoint saved to {self.saved}" if self.saved else "no step had finished, nothing to save")

    def report(self, run_dir: Any) -> str:
        """What happened, for the user (one line per fact)."""
        lines = [self._stopped()]
        if self.requeue:
            lines.append(self.requeue)
        lines.append(f"to continue: python train.py <the same overrides> ckpt_path=auto paths.run_dir={run_dir}")
        return "\n".join(lines)
