"""``python train.py [experiment=NAME] [key=value ...]``: compose → validate → claim the run directory → check the
resume and the memory → instantiate → fit → report.

The system comes from ``cfg.system`` (the diffusion UNet, or the VQ-VAE's stage 1), the data from ``cfg.data``;
all outputs go to the run directory (``paths.output_dir``): ``checkpoints/``, ``samples/``, ``wandb/`` or
``csv/``, and Hydra's ``.hydra/`` config record.

Exit codes (:mod:`voxdiff.cli.exit_codes`, the README's "Errors and exit codes"): 0 done; 2 refused before
anything ran (a config value, a checkpoint, the run directory); 3 a NaN/inf loss stopped training; 4 the step does
not fit the GPU (or the host's memory for a CPU run); 5 the data was refused; 6 a write failed; 7 ran out of memory
after the preflight's check passed (:mod:`voxdiff.cli.out_of_memory`: the phase, the memory measured beside the
prediction, the last good checkpoint, ``memory_error.json``); 143 SIGTERM (a resume checkpoint was saved).
"""

from __future__ import annotations

import logging
import socket
import sys
from pathlib import Path
from typing import Any, NoReturn

from omegaconf import DictConfig

from voxdiff.cli.exit_codes import (
    EXIT_CONFIG,
    EXIT_NO_FIT,
    EXIT_NONFINITE,
    EXIT_TERMINATED,
    hydra_main,
    known_failure,
    refusals,
)
from voxdiff.cli.run_dir import claim, process_rank, release
from voxdiff.config import batch_size_is_auto, check_name, instantiate_config, plain
from voxdiff.errors import ConfigError, Problems, boolean
from voxdiff.run.spec import RunSpec, run_spec_problems

log = logging.getLogger("voxdiff.train")

__all__ = ["EXIT_CONFIG", "EXIT_NONFINITE", "main", "resume_path", "run", "train", "validate"]


class DoesNotFit(Exception):
    """The preflight's memory verdict refused the run (``EXIT_NO_FIT``); the message lists its fixes."""


def validate(cfg: DictConfig) -> RunSpec:
    """The static checks of a training config, run before anything is built (no model, no data, no GPU): the run
    spec (:func:`voxdiff.run.spec.run_spec_problems`: trainer, kind, strategy, GPU type, encoding and shapes, batch,
    precision on this run's device, the UNet and its rules, the step, sampling; or the VQ-VAE), the run's own keys
    (``task_name``, ``overwrite``, ``ckpt_path``) and what the encoding needs now (a learned one: readable weights),
    every problem collected in one pass.

    Returns:
        The run spec.

    Raises:
        ConfigError: the one problem found, or :class:`~voxdiff.errors.ConfigErrors` naming every problem.
    """
    spec, found = run_spec_problems(cfg)
    problems = Problems(found)
    problems(lambda: check_name("task_name", cfg.get("task_name")))
    problems(lambda: boolean("overwrite", cfg.get("overwrite", False), fix="use overwrite=true or false"))
    ckpt = cfg.get("ckpt_path")
    if ckpt is not None and ckpt not in ("auto", "last") and "://" not in str(ckpt) and not Path(str(ckpt)).is_file():
        problems.found.append(ConfigError(
            "ckpt_path", ckpt, "no such checkpoint file",
            "point it at a .ckpt, e.g. <run dir>/checkpoints/last.ckpt, ckpt_path=auto (resume from this run "
            "directory if it has a checkpoint), or ckpt_path=null"))
    if spec is not None:  # what the encoding needs (a learned one: readable weights) now, not after data loading
        problems(spec.encoding.check_ready)
    problems.raise_all()
    return spec


def resume_path(ckpt_path: Any, run_dir: Path) -> str | None:
    """``ckpt_path`` as ``trainer.fit`` takes it. ``auto``: the newest of this run directory's preemption checkpoint
    (``hpc_ckpt_N.ckpt``, written by Lightning's SLURM environment on SIGUSR1) and ``checkpoints/last.ckpt``, or
    None when there is neither (a fresh start). A requeued Slurm job resumes this way."""
    if ckpt_path != "auto":
        return None if ckpt_path is None else str(ckpt_path)
    candidates = [p for p in [*run_dir.glob("hpc_ckpt_*.ckpt"), run_dir / "checkpoints" / "last.ckpt"] if p.is_file()]
    return str(max(candidates, key=lambda p: p.stat().st_mtime)) if candidates else None


def _one_console_log() -> None:
    """Under Hydra's logging, Lightning's own console handler prints every message a second time: drop it."""
    if logging.getLogger().handlers:
        for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
            logger = logging.getLogger(name)
            for handler in list(logger.handlers):
                if type(handler) is logging.StreamHandler:
                    logger.removeHandler(handler)
            logger.propagate = True


def choose_batch_size(cfg: DictConfig) -> None:
    """``data.batch_size=auto``: the preflight's choice for this machine (:func:`voxdiff.preflight.autofit.autofit`
    against the local GPU, or the host's memory for a CPU run, as :func:`prepare`'s verdict), set in ``cfg`` (so
    the run's stored config and its checkpoints record the number) and printed with its candidates. The rest of the
    config is validated first, at batch 1. When no candidate fits, batch 1 goes on to the memory verdict, which
    refuses it with its fixes."""
    # deferred: the preflight's trace engine costs seconds at start-up; a refused config exits before
    from omegaconf import OmegaConf

    from voxdiff.preflight.autofit import autofit
    from voxdiff.preflight.check import training_verdict, with_overrides

    spec = validate(with_overrides(cfg, {"data.batch_size": 1}))
    report = autofit(cfg, verdict=lambda c: training_verdict(c, suggest=False), run=spec,
                     progress=(lambda line: print(f"[voxdiff] data.batch_size=auto: {line}", flush=True))
                     if process_rank() == 0 else None)
    chosen = dict(report.best.settings) if report.best is not None else {"data.batch_size": 1}
    for key, value in chosen.items():
        OmegaConf.update(cfg, key, value, merge=False, force_add=True)
    if process_rank() == 0:
        print(report.table(), flush=True)
        print("[voxdiff] data.batch_size=auto: " + (f"chosen {' '.join(report.best.overrides)}"
                                                     if report.best is not None else "no candidate fits; batch 1"),
              flush=True)


def prepare(cfg: DictConfig, run_dir: Path, spec: RunSpec) -> tuple[str | None, Any, Any]:
    """Everything between a valid config and building the run, in this order: claim the run directory (rank 0:
    lock, no fresh run over checkpoints, stale temp files removed); check the checkpoint to resume from (kind,
    architecture, what changed); the preflight's memory verdict for this machine.

    Returns:
        ``(ckpt_path for trainer.fit, ResumePlan or None, the preflight's verdict or None)``.

    Raises:
        ConfigError: the run directory, or the checkpoint, is refused.
        DoesNotFit: the training step does not fit this machine's memory.
    """
    # deferred: Lightning and the preflight's trace engine cost seconds at start-up; a refused config exits before
    from voxdiff.cli.preflight import details
    from voxdiff.lightning.resume import check_resume
    from voxdiff.preflight.check import training_verdict

    if process_rank() == 0:
        for note in claim(run_dir, cfg.get("ckpt_path"), bool(cfg.get("overwrite", False))):
            print(f"[voxdiff] {note}", flush=True)
    ckpt_path = resume_path(cfg.get("ckpt_path"), run_dir)
    if cfg.get("ckpt_path") == "auto" and ckpt_path is None:
        print(f"[voxdiff] ckpt_path=auto: no last.ckpt or hpc_ckpt_*.ckpt in {run_dir}: a fresh start", flush=True)
    plan = None
    if ckpt_path is not None and ckpt_path != "last" and "://" not in ckpt_path:
        plan = check_resume(cfg, ckpt_path, spec)
    verdict = training_verdict(cfg, spec)
    if verdict is not None and not verdict.ok:
        if verdict.fits:  # the memory fits; the disk or the host memory does not
            raise DoesNotFit(f"does not fit: {verdict.misfits[0]}; nothing was built\n{details(verdict)}")
        raise DoesNotFit(
            f"does not fit: the run needs {verdict.need_gib:.1f} GiB (predicted peak "
            f"{verdict.per_gpu_peak_gib:.1f} GiB, set by {verdict.peak_phase}, with the safety margin), the "
            f"{verdict.budget_source} has {verdict.budget_gib:.1f} GiB; nothing was built. Fix: one of the changes "
            f"below, or a machine with more memory\n{details(verdict)}")
    if verdict is not None:
        print(f"[voxdiff] memory: predicted peak {verdict.per_gpu_peak_gib:.2f} GiB per process (set by "
              f"{verdict.peak_phase}), needs {verdict.need_gib:.2f} GiB of {verdict.budget_gib:.1f} GiB "
              f"({verdict.budget_source})", flush=True)
        import torch
        from omegaconf import OmegaConf

        needs = verdict.needs
        on_gpu = torch.cuda.is_available() and OmegaConf.select(cfg, "trainer.accelerator") != "cpu"
        for line in [*(needs.lines() if needs else []), *(needs.warnings if needs else [])]:
            if on_gpu or not line.startswith("time:"):  # the predicted time is a GPU's
                print(f"[voxdiff] {line}", flush=True)
    elif spec.kind == "diffusion":
        print("[voxdiff] memory: not checked (the preflight models trainer.precision bf16-mixed and 32-true)",
              flush=True)
    return ckpt_path, plan, verdict


def run(cfg: DictConfig, spec: RunSpec, ckpt_path: str | None = None, plan: Any = None,
        verdict: Any = None) -> dict[str, Any]:
    """Build the data, the system, the logger and the Trainer from a validated config, fit, and report.

    Args:
        cfg: the config (validated).
        spec: its run spec (:func:`validate`).
        ckpt_path: the checkpoint to resume from (:func:`prepare`), or None.
        plan: what :func:`voxdiff.lightning.resume.check_resume` found, printed before the fit.
        verdict: the preflight's verdict on the run (:func:`prepare`), which a memory stop compares with.

    Raises:
        NonFiniteLossError: a NaN/inf loss or gradient norm; the message names the last good checkpoint.
        MemoryStop: the run ran out of memory (:mod:`voxdiff.cli.out_of_memory`; its record written to the run
            directory first).
        RankFailed: a process this one launched failed on its own (:func:`end_launched_ranks`).

    Returns:
        ``{"run_dir", "metrics", "last_checkpoint", "best_checkpoint"}`` (metrics as floats).
    """
    # deferred: Lightning costs seconds at start-up; a refused config exits before it is imported
    import lightning as L
    import torch
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from voxdiff.cli.out_of_memory import Predicted, is_out_of_memory, memory_stop, write_record
    from voxdiff.lightning.callbacks import CheckpointPathsInside, ConfigInCheckpoint, FailurePoint, MeasuredRun
    from voxdiff.lightning.diffusion import NonFiniteLossError
    from voxdiff.lightning.preemption import SaveOnSigterm
    from voxdiff.lightning.resume import FollowCurrentOptimizer
    from voxdiff.lightning.trainer import (
        build_trainer,
        configure_cpu_threads,
        instantiate_callbacks,
        instantiate_loggers,
    )

    _one_console_log()
    L.seed_everything(int(cfg.seed) + process_rank(), workers=True)  # DDP broadcasts rank 0's initial weights
    threads = configure_cpu_threads()
    run_dir = Path(cfg.paths.output_dir)
    log.info("run directory: %s", run_dir.resolve())
    print(f"[voxdiff] run directory: {run_dir.resolve()}  (host {socket.gethostname()}, rank {process_rank()}, "
          f"torch threads: {threads})", flush=True)

    # the Trainer, its callbacks and loggers first: what Lightning refuses in them is refused before any data is made
    logger = instantiate_loggers(cfg.get("logger"))
    record = {k: plain(cfg[k]) for k in cfg if k != "hydra"}  # the resolved config, for sample.py and resumes
    on_sigterm = SaveOnSigterm()
    failure = FailurePoint()
    # the step as the run's clock sees it: the GPU's time and the wait for data (with no workers, loading between steps)
    needs = verdict.needs if verdict is not None else None
    step_s = needs.wall_step_s if needs is not None else None
    parts = ({"gpu_ms": needs.step_s * 1e3, "data_wait_ms": (step_s - needs.step_s) * 1e3}
             if needs is not None and needs.step_s is not None and step_s is not None else None)
    measured = MeasuredRun(verdict.predicted_phases_gib() if verdict is not None else None,
                           step_s * 1e3 if step_s is not None else None, run_dir,
                           context={"gpu": verdict.gpu.name if verdict is not None and verdict.gpu is not None
                                    and spec.device_type == "cuda" else None, "config": record,
                                    "predicted_step": parts})
    callbacks = [*instantiate_callbacks(cfg.get("callbacks")), ConfigInCheckpoint(record), CheckpointPathsInside(),
                 on_sigterm, failure, measured]
    if ckpt_path is not None:
        callbacks.append(FollowCurrentOptimizer())
    trainer = build_trainer(cfg.trainer, callbacks=callbacks, logger=logger)
    datamodule = instantiate_config(cfg.data, _convert_="all")
    datamodule.setup("fit")  # load (and check) the data before the model is built
    # the system is built from the run spec's part (validated with the rest; resolved for this run's device)
    # with data.covariates, the encoding the data module fitted on the training split (stored in the checkpoints)
    fitted = getattr(datamodule, "covariate_encoding", None)
    if plan is not None:  # a resume continues the encoding its model learned, or is refused
        plan.check_covariates(fitted)
    system = instantiate_config(cfg.system, _partial_=True)(
        spec=spec.system, **({"covariates": fitted.to_plain()} if fitted is not None else {}))
    if plan is not None:
        print("\n".join(f"[voxdiff] {line}" for line in plan.summary().splitlines()), flush=True)
    elif ckpt_path is not None:
        print(f"[voxdiff] resuming from {ckpt_path}", flush=True)
    try:
        try:
            trainer.fit(system, datamodule=datamodule, ckpt_path=ckpt_path, weights_only=True)
        except BaseException as e:
            end_launched_ranks(trainer, e)
            raise
    except NonFiniteLossError as e:
        last = last_checkpoint(trainer)
        e.args = (f"{e}. The last good checkpoint: {last or 'none was written yet'}",)
        raise
    except Exception as e:
        if not is_out_of_memory(e):
            raise
        # the allocator's peaks since MeasuredRun's last reset: those of the failing phase (None: no statistics)
        after = (dict(zip(("max_memory_allocated", "max_memory_reserved"), map(int, measured.stats[0]())))
                 if measured.stats is not None else None)
        stop = memory_stop(e, phase=failure.phase or "training", step=int(failure.step or 0),
                           epoch=int(failure.epoch or 0), batch_size=int(cfg.data.batch_size),
                           checkpointing=spec.unet.gradient_checkpointing if spec.unet is not None else None,
                           predicted=Predicted.of(verdict), last_checkpoint=last_checkpoint(trainer),
                           measured=after)
        if measured.peaks:  # the phases measured before the failure (on a GPU)
            stop.record["phases_measured"] = measured.record()["memory"]
        path = write_record(stop, run_dir, process_rank())
        stop.args = (f"{stop}. The measurements: {path}",)
        raise stop from e
    except SIGTERMException as e:
        e.report = on_sigterm.report(run_dir.resolve())  # type: ignore[attr-defined]
        raise
    finally:
        if any(type(lg).__name__ == "WandbLogger" for lg in trainer.loggers):
            import wandb

            wandb.finish(exit_code=0 if trainer.state.status.value == "finished" else 1)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if torch.is_tensor(v) and v.numel() == 1}
    ckpts = {type(c).__name__: c for c in trainer.checkpoint_callbacks}
    report = {
        "run_dir": str(run_dir.resolve()),
        "metrics": metrics,
        "last_checkpoint": getattr(ckpts.get("LastCheckpoint"), "last_model_path", "") or None,
        "best_checkpoint": getattr(ckpts.get("ModelCheckpoint"), "best_model_path", "") or None,
    }
    print(f"[voxdiff] done: {trainer.global_step} steps; " + ", ".join(f"{k}={v:.4g}" for k, v in
          sorted(metrics.items())), flush=True)
    print(f"[voxdiff] last checkpoint: {report['last_checkpoint']}\n[voxdiff] run directory: {report['run_dir']}",
          flush=True)
    return report


def last_checkpoint(trainer: Any) -> str | None:
    """The checkpoint of the latest step a checkpoint callback of ``trainer`` wrote that is on disk (a failed write
    leaves the path behind), or None: ``last.ckpt`` (the resume point) where one was written at that step, else the
    best model's file (early in a run, before ``last.ckpt``'s first step, the only one)."""
    found: list[tuple[int, bool, int, str]] = []  # (step, is a last.ckpt, mtime, path)
    for callback in trainer.checkpoint_callbacks:
        step = int(getattr(callback, "_last_global_step_saved", 0))  # Lightning's: the step of its newest file
        last = getattr(callback, "last_model_path", "")
        found += [(step, p == last, Path(p).stat().st_mtime_ns, p)
                  for p in {last, *getattr(callback, "best_k_models", {})} if p and Path(p).is_file()]
    return max(found)[3] if found else None


class RankFailed(Exception):
    """A process this one launched failed on its own, and this one's error followed from it (with gloo, a
    ``Connection closed by peer`` when the failed process exited): the run exits with that process's code.

    Attributes:
        code: the failed process's exit code (128 + the signal for one killed by a signal).
    """

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def own_failure(error: BaseException) -> bool:
    """Whether ``error`` is one this process reports with its own exit code (a non-finite loss, SIGTERM, an
    interrupt, or a command's known failure: bad input, a failed write, out of memory,
    :func:`voxdiff.cli.exit_codes.known_failure`) rather than a consequence of another process's failure."""
    return not isinstance(error, Exception) or ends_every_rank(error) or known_failure(error) is not None


def ends_every_rank(error: BaseException) -> bool:
    """Whether ``error`` stops every process of the run at the same step by itself: a non-finite loss (the guard's
    record is all-reduced: every rank raises at the same check) or SIGTERM (Lightning forwards it to the processes it
    launched; all stop at the next batch boundary)."""
    # deferred: Lightning costs seconds at start-up; a refused config exits before it is imported
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from voxdiff.lightning.diffusion import NonFiniteLossError

    return isinstance(error, (NonFiniteLossError, SIGTERMException))


def end_launched_ranks(trainer: Any, error: BaseException) -> None:
    """This process failed with ``error``: end the run's other processes, if it launched them
    (:func:`voxdiff.lightning.distributed.stop_launched_processes`: they would wait for it in a collective), and say
    what became of each. Where ``error`` says a peer's connection closed
    (:func:`~voxdiff.lightning.distributed.peer_gone`), the peer that is ending gets up to ``PEER_EXIT_WAIT_S`` to
    end, so that its code is the run's. Where it stops every rank at the same step (:func:`ends_every_rank`), each
    gets as long to end by itself: none waits in a collective, and a rank's end (its teardown and its own message,
    then seconds in the interpreter's exit here) outlasts the short grace on a loaded machine (it was killed, its own
    message lost).

    Raises:
        RankFailed: one of them had failed on its own and ``error`` is not one of this process's own failures
            (:func:`own_failure`): the run exits with that process's code, not with a traceback of this one's.
    """
    # deferred: Lightning costs seconds at start-up; a refused config exits before it is imported
    from voxdiff.lightning.distributed import (
        LAUNCHED_GRACE_S,
        PEER_EXIT_WAIT_S,
        exit_code,
        peer_gone,
        stop_launched_processes,
    )

    ended = stop_launched_processes(trainer, grace_s=PEER_EXIT_WAIT_S if ends_every_rank(error) else LAUNCHED_GRACE_S,
                                    first_exit_s=PEER_EXIT_WAIT_S if peer_gone(error) else 0.0)
    if not ended:
        return
    failed = [(r, code) for r, code in ended.items() if isinstance(code, int) and code != 0]
    if failed and not own_failure(error):
        rank, code = failed[0]
        cause = " ".join(str(error).split())[:160]
        raise RankFailed(f"local rank {rank} failed (exit code {exit_code(code)}; its message is above), and rank "
                         f"{process_rank()} stopped with it ({type(error).__name__}: {cause})",
                         exit_code(code)) from error

    def fate(code: int | str) -> str:
        if code == "killed":
            return f"killed after {LAUNCHED_GRACE_S:g} s (it was waiting for this one in a collective)"
        return f"ended by signal {-int(code)}" if int(code) < 0 else f"ended (exit code {code})"

    what = ", ".join(f"local rank {r} {fate(code)}" for r, code in ended.items())
    how = "was interrupted" if isinstance(error, (KeyboardInterrupt, SystemExit)) else "failed"
    print(f"[voxdiff] rank {process_rank()} {how}; the processes it launched: {what}", file=sys.stderr, flush=True)


def _exit(code: int, message: str, prefix: str = "config error") -> NoReturn:
    print(f"[voxdiff] {prefix}: {message}", file=sys.stderr, flush=True)
    raise SystemExit(code)


def train(cfg: DictConfig) -> dict[str, Any]:
    """validate → prepare → run, with the exits of the command line: every refusal and every stop prints one clear
    message (no traceback) and exits with its code (:mod:`voxdiff.cli.exit_codes`)."""
    # deferred: Lightning costs seconds at start-up; a refused config exits before it is imported
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from voxdiff.lightning.diffusion import NonFiniteLossError

    run_dir = Path(cfg.paths.output_dir)
    try:
        with refusals(cfg):  # a refused config, data or write, and what Hydra or Lightning refuse while building
            try:
                if batch_size_is_auto(cfg):
                    choose_batch_size(cfg)
                spec = validate(cfg)
                ckpt_path, plan, verdict = prepare(cfg, run_dir, spec)
            except DoesNotFit as e:
                _exit(EXIT_NO_FIT, str(e), prefix="memory")
            try:
                return run(cfg, spec, ckpt_path, plan, verdict)
            except NonFiniteLossError as e:
                _exit(EXIT_NONFINITE, str(e), prefix="training stopped")
            except SIGTERMException as e:
                _exit(EXIT_TERMINATED, getattr(e, "report", "stopped by SIGTERM"), prefix="SIGTERM")
            except RankFailed as e:
                _exit(e.code, str(e), prefix="rank failed")
    finally:
        leave_process_group()
        release(run_dir)


def leave_process_group() -> None:
    """Destroy the process group that Lightning's DDP and FSDP strategies set up and leave up, if there is one:
    its gloo/NCCL threads are then joined here, not at the interpreter's exit, where a thread still joinable aborts
    the process (``terminate called without an active exception``, exit -6, seen once in about 8 suite runs at the
    end of the two-process CPU FSDP run of ``tests/cli/test_fsdp.py``; PyTorch asks for this call at the end of a
    distributed program)."""
    dist = sys.modules.get("torch.distributed")  # never imported (a refused config): no group to leave
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@hydra_main("train")
def main(cfg: DictConfig) -> float | None:
    """The ``voxdiff-train`` / ``python train.py`` entry point; returns the last ``val/loss`` (for sweepers)."""
    return train(cfg)["metrics"].get("val/loss")


if __name__ == "__main__":
    main()
