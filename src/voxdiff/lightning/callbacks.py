"""Small Lightning callbacks: a progress bar that never waits for the GPU, throughput on it, an always-current
``last.ckpt``, the run's config in every checkpoint, only the checkpoint paths inside the run restored on resume,
and fault injectors for tests (a NaN batch, a hold at a step).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, TQDMProgressBar

from voxdiff.checkpoint import CONFIG_KEY, guide_checkpoint_name  # CONFIG_KEY: the run's resolved config
from voxdiff.diffusion.guidance import check_guide_step
from voxdiff.errors import integer, one_of
from voxdiff.files import atomic_write
from voxdiff.run.spec import check_last_every, check_steps_window

log = logging.getLogger(__name__)

#: the fields of a ``ModelCheckpoint`` state that name one file each (``best_k_models`` names several)
_PATH_FIELDS = ("best_model_path", "kth_best_model_path", "last_model_path")


class ProgressBar(TQDMProgressBar):
    """Lightning's TQDM bar, plus values given as host numbers (:meth:`show`): the training loss, steps per second,
    the compile time.

    Lightning turns every ``self.log(..., prog_bar=True)`` value into a number after every batch; for a GPU tensor
    that waits for the GPU to finish its queued work, every step. The training step therefore logs its tensors to
    the logger only (read at logging steps) and hands the bar a number at its logging steps.
    """

    def __init__(self, refresh_rate: int = 1, leave: bool = False) -> None:
        super().__init__(refresh_rate=refresh_rate, leave=leave)
        self.values: dict[str, float] = {}

    @staticmethod
    def show(trainer: L.Trainer, key: str, value: float) -> None:
        """Put ``key: value`` (a host number) on the bar of ``trainer``, if it has a :class:`ProgressBar`."""
        bar = trainer.progress_bar_callback
        if isinstance(bar, ProgressBar):
            bar.values[key] = float(value)

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        return {**super().get_metrics(trainer, pl_module), **self.values}


class StepsPerSecond(L.Callback):
    """Log ``train/steps_per_s`` (optimizer steps per second of training time) on the progress bar and the logger.

    Measured over windows of ``window`` steps so that the number is stable; time spent in validation (and in the
    sampling it triggers) is left out, and so is the first step (compilation, data cache warm-up). Logged once per
    window as a CPU tensor (a Python number would be copied to the GPU, which waits for its queued work), and
    shown on a :class:`ProgressBar`.

    Args:
        window: steps per measurement.
    """

    def __init__(self, window: int = 10) -> None:
        check_steps_window(window)
        self.window = window
        self._t0: float | None = None
        self._step0 = 0
        self._paused = 0.0  # validation seconds inside the current window
        self._val_start: float | None = None
        self._value: float | None = None

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        now = time.perf_counter()
        step = trainer.global_step
        if self._t0 is None:
            self._t0, self._step0, self._paused = now, step, 0.0
        elif step - self._step0 >= self.window:
            self._value = (step - self._step0) / max(now - self._t0 - self._paused, 1e-9)
            self._t0, self._step0, self._paused = now, step, 0.0
            pl_module.log("train/steps_per_s", torch.tensor(self._value), on_step=True, on_epoch=False, batch_size=1)
            ProgressBar.show(trainer, "steps_per_s", self._value)

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._val_start = time.perf_counter()

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._val_start is not None:
            self._paused += time.perf_counter() - self._val_start
            self._val_start = None


class LastCheckpoint(ModelCheckpoint):
    """One ``last.ckpt`` kept current: every ``every_n_train_steps`` optimizer steps and when ``fit`` ends.

    Lightning's ``ModelCheckpoint(save_last=True)`` combined with a monitored metric rewrites ``last.ckpt`` only
    when the metric improves; this keeps the best model to the ``best`` callback and makes ``last.ckpt`` the
    resume point. A run that fails (a NaN, a crash) writes nothing at the end: the last good file stays.

    Args:
        dirpath: the checkpoint folder (``<run dir>/checkpoints``).
        every_n_train_steps: write ``last.ckpt`` every this many optimizer steps.
    """

    def __init__(self, dirpath: str | Path, every_n_train_steps: int = 1000) -> None:
        check_last_every(every_n_train_steps)
        super().__init__(dirpath=dirpath, save_top_k=0, save_last=True, every_n_train_steps=every_n_train_steps,
                         enable_version_counter=False)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.fast_dev_run or trainer.global_step == self._last_global_step_saved:
            return
        self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))


class GuideSnapshot(L.Callback):
    """One checkpoint of the run as it was after optimizer step ``step``: ``checkpoints/guide-step<N>.ckpt``, the
    *guide* of autoguidance (``sample.py`` / ``evaluate.py`` ``autoguide_scale=``; Karras et al. 2024, "Guiding a
    diffusion model with a bad version of itself"): the same model, less trained, whose errors the final model's
    prediction is pushed away from. Written through the Trainer (atomically; every rank calls it, as Lightning's
    saving needs) when the run's step is ``step``, which a run reaches once: a resumed run past ``step`` keeps the
    file it has. (No rank asks whether the file exists first: on a shared disk a slower rank would see rank 0's file
    and skip a save the others wait in.)

    Args:
        dirpath: the checkpoint folder (``<run dir>/checkpoints``).
        step: the optimizer step after which the snapshot is taken (> 0); None: none is taken.
    """

    def __init__(self, dirpath: str | Path, step: int | None = None) -> None:
        check_guide_step(step)
        self.path = Path(dirpath) / guide_checkpoint_name(step) if step is not None else None
        self.step = step

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.path is not None and trainer.global_step == self.step:
            trainer.save_checkpoint(str(self.path))


class ConfigInCheckpoint(L.Callback):
    """Store the run's resolved config (plain data) in every checkpoint under ``voxdiff_config``.

    ``sample.py`` reads the data config from it (where the validation masks come from).
    """

    def __init__(self, config: Mapping[str, Any]) -> None:
        self.config = dict(config)

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        checkpoint[CONFIG_KEY] = self.config


def paths_inside(state: dict[str, Any], folder: str | Path) -> list[str]:
    """Drop, in place, the file paths of a ``ModelCheckpoint`` state (``best_k_models``, ``best_model_path``,
    ``kth_best_model_path``, ``last_model_path``) that do not lie inside ``folder``; returns the dropped paths.

    A path is kept when it is a local, absolute path without ``..`` that resolves (symbolic links followed) inside
    ``folder`` resolved. A dropped single path becomes ``""`` (Lightning's "none"), a dropped ``best_k_models`` entry
    is removed.
    """
    inside = Path(os.path.realpath(folder))

    def ok(path: Any) -> bool:
        if not isinstance(path, str) or "://" in path or not os.path.isabs(path) or ".." in Path(path).parts:
            return False
        return Path(os.path.realpath(path)).is_relative_to(inside)

    dropped: list[str] = []
    models = state.get("best_k_models")
    if isinstance(models, dict):
        dropped += [p for p in models if not ok(p)]
        state["best_k_models"] = {p: v for p, v in models.items() if ok(p)}
    for key in _PATH_FIELDS:
        if state.get(key) and not ok(state[key]):
            dropped.append(state[key])
            state[key] = ""
    return sorted(set(dropped), key=dropped.index)


class CheckpointPathsInside(L.Callback):
    """On resume, the file paths a checkpoint's ``ModelCheckpoint`` states name are kept only inside each callback's
    own folder (#29).

    Lightning restores them — ``best_k_models``, ``kth_best_model_path`` and ``last_model_path`` when the stored
    ``dirpath`` equals the callback's, ``best_model_path`` always — and *deletes* the file one names when a newer
    checkpoint replaces it, where the path is under the callback's folder by its text (``<dirpath>/../../x``
    passes) or is not local (``s3://``). A checkpoint is a file people share: before any state is restored
    (``on_load_checkpoint`` runs for every callback before ``load_state_dict``), the paths outside the folder are
    dropped (:func:`paths_inside`) and the run says so.
    """

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        states = checkpoint.get("callbacks")
        if not isinstance(states, dict):
            return
        for callback in trainer.checkpoint_callbacks:
            state = states.get(callback.state_key)
            if isinstance(state, dict) and getattr(callback, "dirpath", None) is not None:
                dropped = paths_inside(state, callback.dirpath)
                if dropped:
                    log.warning("the checkpoint names files outside %s for %s: not restored (%s)", callback.dirpath,
                                type(callback).__name__, ", ".join(dropped))


class PoisonBatch(L.Callback):
    """Fault injection: replace the batch's volumes (``image``, ``mask`` and their latents) with NaN at one step.

    Exercises the non-finite-loss path end to end (``+callbacks.poison._target_=voxdiff.lightning.callbacks.
    PoisonBatch +callbacks.poison.at_step=5``): training must stop at that step with the last good checkpoint
    intact.

    Args:
        at_step: the ``trainer.global_step`` (optimizer steps done so far) whose batch is poisoned.
        value: what to write (NaN by default; ``inf`` works too).
    """

    def __init__(self, at_step: int, value: float = math.nan) -> None:
        self.at_step = int(at_step)
        self.value = float(value)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if trainer.global_step != self.at_step:
            return
        for key in ("image", "mask", "image_z", "mask_z"):
            if key in batch:
                batch[key] = torch.full_like(batch[key], self.value)  # new tensors: never poison a data cache


class HoldAtStep(L.Callback):
    """Fault injection: pause training at one step until a file appears, so that a test acts (requeues, signals,
    kills) at a step it chooses, however fast or slow the machine is.

    At the start of the batch with ``trainer.global_step == at_step`` (that many optimizer steps done), unless
    ``release_file`` already exists: write ``release_file + ".held"`` (the step, the time) and wait until
    ``release_file`` exists. A SIGTERM while held (``scontrol requeue``, ``scancel``) ends the wait: the batch
    then runs to its end and Lightning stops there, as it does for a SIGTERM that arrives during any batch (a
    checkpoint saved at the signal is therefore at ``at_step + 1``). A run resumed at or after ``at_step`` with the
    release file present does not hold again.

    ``+callbacks.hold._target_=voxdiff.lightning.callbacks.HoldAtStep +callbacks.hold.at_step=6
    +callbacks.hold.release_file=/tmp/go``

    Args:
        at_step: the ``trainer.global_step`` at which to hold.
        release_file: the file whose existence releases the hold.
        timeout_s: give up waiting after this many seconds and raise (a test that forgot to release must not
            leave a job running forever).
    """

    def __init__(self, at_step: int, release_file: str | Path, timeout_s: float = 600.0) -> None:
        integer("at_step", at_step, minimum=0, example=1)
        self.at_step = at_step
        self.release_file = Path(release_file)
        self.held_file = self.release_file.with_name(self.release_file.name + ".held")
        self.timeout_s = float(timeout_s)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if trainer.global_step != self.at_step or self.release_file.exists():
            return
        self.held_file.write_text(f"{trainer.global_step} {datetime.now().isoformat()}\n")
        deadline = time.monotonic() + self.timeout_s
        while not self.release_file.exists() and not trainer.received_sigterm:
            if time.monotonic() > deadline:
                raise TimeoutError(f"held at step {self.at_step} for {self.timeout_s} s: nothing created "
                                   f"{self.release_file}")
            time.sleep(0.05)


#: Lightning's stages (``trainer.state.stage``) as a run's phases are named (the preflight's, and train.py's)
PHASES = {"train": "training", "validate": "validation", "sanity_check": "sanity check"}


class FailurePoint(L.Callback):
    """Where a fit failed, read by ``train.py`` after ``trainer.fit`` raised: Lightning resets its stage before the
    exception reaches the caller, so the phase is taken in ``on_exception``, which it calls first.

    Attributes (None until a failure): ``phase`` (``training``, ``validation``, ``sanity check``, or ``sampling``
    while the system writes samples: its ``sampling_now``), ``step`` (``trainer.global_step``), ``epoch``.
    """

    def __init__(self) -> None:
        self.phase: str | None = None
        self.step: int | None = None
        self.epoch: int | None = None

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        stage = getattr(trainer.state.stage, "value", None)
        self.phase = ("sampling" if getattr(pl_module, "sampling_now", False)
                      else PHASES.get(stage, str(stage or "setup")))
        self.step, self.epoch = trainer.global_step, trainer.current_epoch


def _allocator_size(gib: float) -> str:
    """A size as PyTorch's allocator messages write it (``c10::CachingAllocator::format_size``): bytes below a
    KiB, else KiB, MiB or GiB with two decimals."""
    n = gib * 2**30
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} bytes"


class ExhaustMemory(L.Callback):
    """Fault injection: the allocator's failure at one step of one phase, as PyTorch raises it
    (``torch.OutOfMemoryError`` with the CUDA caching allocator's message), so that a test sees what ``train.py``
    does when a run runs out of memory after the preflight said it fits.

    ``+callbacks.oom._target_=voxdiff.lightning.callbacks.ExhaustMemory +callbacks.oom.at_step=5
    +callbacks.oom.phase=validation +callbacks.oom.allocated_gib=80``

    Args:
        at_step: the ``trainer.global_step`` at (or, for ``sampling``, from) which it fails.
        phase: ``training`` (the start of that step's batch), ``validation`` (a validation batch) or ``sampling``
            (the system's ``generate`` while it writes samples).
        allocated_gib, requested_gib, capacity_gib, free_gib, unallocated_gib: the figures of the message.
        others_gib: memory of another process on the device (0: none named).
        rank: the one process (``trainer.global_rank``) that fails; the others go on (None: every process).
    """

    def __init__(self, at_step: int, phase: str = "training", allocated_gib: float = 76.0,
                 requested_gib: float = 2.0, capacity_gib: float = 79.19, free_gib: float = 0.5,
                 unallocated_gib: float = 0.3, others_gib: float = 0.0, rank: int | None = None) -> None:
        integer("at_step", at_step, minimum=0, example=1)
        one_of("phase", phase, ("training", "validation", "sampling"))
        if rank is not None:
            integer("rank", rank, minimum=0, example=1)
        self.at_step, self.phase, self.rank = at_step, phase, rank
        size = _allocator_size
        others = f"Process 4242 has {size(others_gib)} memory in use. " if others_gib else ""
        self.message = (
            f"CUDA out of memory. Tried to allocate {size(requested_gib)}. GPU 0 has a total capacity of "
            f"{size(capacity_gib)} of which {size(free_gib)} is free. {others}Including non-PyTorch memory, "
            f"this process has {size(allocated_gib + unallocated_gib + 0.5)} memory in use. Of the allocated "
            f"memory {size(allocated_gib)} is allocated by PyTorch, and {size(unallocated_gib)} is reserved by "
            "PyTorch but unallocated. If reserved but unallocated memory is large try setting "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.")

    def _fail(self, trainer: L.Trainer) -> None:
        if self.rank is None or trainer.global_rank == self.rank:
            raise torch.OutOfMemoryError(self.message)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self.phase == "training" and trainer.global_step == self.at_step:
            self._fail(trainer)

    def on_validation_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                                  batch_idx: int, dataloader_idx: int = 0) -> None:
        if self.phase == "validation" and trainer.global_step == self.at_step and not trainer.sanity_checking:
            self._fail(trainer)

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.phase != "sampling":
            return
        generate = pl_module.generate

        def failing(*args: Any, **kwargs: Any) -> Any:
            if trainer.global_step >= self.at_step and getattr(pl_module, "sampling_now", False):
                self._fail(trainer)
            return generate(*args, **kwargs)

        pl_module.generate = failing  # type: ignore[method-assign]


#: what :class:`MeasuredRun` measures of memory, in the order it reports them
MEASURED_PHASES = ("training_step1", "training", "validation", "sampling")

#: training steps of a fit before :class:`MeasuredRun` times the step: the compile, and CUDA graphs' warm-up and
#: recording (torch's cudagraph trees record on the step after the first) are not the steady step
TIMED_AFTER_STEPS = 3

#: the phases whose wall time :class:`MeasuredRun` reports (``phase_time``), as it names them: the first step (its
#: compile and warm-up), each validation, each sampling
TIMED_PHASES = {"training_step1": "first step", "validation": "validation", "sampling": "sampling"}


class MeasuredRun(L.Callback):
    """What a fit measured against what the preflight predicted for it: the peak device memory of each phase and
    the steady training step's time. ``train.py`` prints them side by side at the end, logs them and writes them to
    ``measured.json`` in the run directory, so that every GPU run is a row of the preflight's error table (and
    ``bench/measure_phases.py`` reads its peaks here).

    **Memory** (on a CUDA device). The caching allocator's peak statistics (``torch.cuda.max_memory_allocated``
    and ``max_memory_reserved``) are host-side bookkeeping, updated as the host issues allocations: reading and
    resetting them never waits for the GPU. Each phase is the span between two of Lightning's hooks (callbacks run
    before the system's own hook of the same name):

    * ``training_step1``: the fit's first training step (AdamW's state is created in it);
    * ``training``: every later training step (the steady step), up to the next validation or the end;
    * ``validation``: from the validation epoch's start (before the system's EMA swap) to its end, before the
      system's epoch end;
    * ``sampling``: from there to the validation's end, when the system wrote samples in between (``write_samples``
      sets ``_last_sampled_step``), and the final samples after training.

    Lightning's sanity check is not a phase (its peak is discarded). Each phase keeps the largest peak of its
    spans: ``{phase: (allocated bytes, reserved bytes)}`` in :attr:`peaks`. With CUDA graphs the allocated peak does
    not see their private pool (the replays allocate nothing); the reserved peak does.

    A reset of the peaks sets the reserved one to what is reserved then, which includes the segments the allocator
    keeps cached from earlier phases: a training span after a validation carries validation's. So training starts
    with the sanity check's cached segments released (``torch.cuda.empty_cache``: nothing of the run is lost, the
    allocator reserves again what it needs), and the training step's reserved peak held against its prediction is
    that of the spans before the first validation (:attr:`first_training_reserved`,
    ``training_before_validation_reserved`` in the record); ``training_reserved`` stays the largest of all (what the
    run held while training).

    **Step time** (on any device). The wall time of the training steps after the first
    :data:`TIMED_AFTER_STEPS` of the fit, validation and sampling left out, over their number: the device is
    synchronised where a timed span starts and ends (after the warm-up steps, around each validation, at the end
    of training), never inside the steady steps, so the host running ahead of the GPU is neither counted nor
    caused. Held against the preflight's predicted step time where the GPU's throughput was measured.

    **Phase time** (on any device). The wall time of the first step (with its compile and warm-up), of each
    validation and of each sampling (:data:`TIMED_PHASES`; the spans of the memory phases, the sanity check not
    among them), the device synchronised at each end: what the preflight's time does not predict yet (it counts
    training steps alone), measured for every run.

    Args:
        predicted: the preflight's prediction for this run, GiB: ``training``, ``validation``, ``sampling``
            (allocated peaks), ``training_reserved`` and ``graph_pool``; what is absent is not compared.
        predicted_step_ms: the preflight's step time for this run (None: not predicted).
        out_dir: where ``measured.json`` goes (rank 0's; ``measured.rank<r>.json`` for rank r > 0); None: not
            written.
        stats: ``(read, reset)``: ``read()`` returns the peaks ``(allocated, reserved)`` since the last
            ``reset()``. Default: ``torch.cuda``'s of the strategy's device; on a device without them (the CPU)
            no memory is measured.
        context: written into ``measured.json`` as given (``train.py``: the run's resolved config and the GPU type
            predicted for, from which ``bench/fit_step_time.py --runs`` recounts the step's cost).
    """

    def __init__(self, predicted: Mapping[str, float] | None = None, predicted_step_ms: float | None = None,
                 out_dir: str | Path | None = None, stats: tuple[Any, Any] | None = None,
                 context: Mapping[str, Any] | None = None) -> None:
        self.context = dict(context or {})
        self.predicted = dict(predicted or {})
        self.predicted_step_ms = predicted_step_ms
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self.stats = stats
        self.peaks: dict[str, tuple[int, int]] = {}
        #: the reserved peak of the training spans before the first validation (None: none measured)
        self.first_training_reserved: int | None = None
        #: releases the allocator's cached segments (``torch.cuda.empty_cache`` on a CUDA device; None: nothing)
        self.release: Any = None
        self._validated = False  # a (non-sanity) validation has run
        self._steps_done = 0  # training steps of this fit
        self._sampled_at: int | None = None
        self._sync: Any = lambda: None
        self._span: tuple[float, int] | None = None  # (start time, global step) of the timed span under way
        self.timed_s = 0.0
        self.timed_steps = 0
        #: ``{phase: (seconds, spans)}``: the wall time of the spans of each phase of :data:`TIMED_PHASES`
        self.phase_s: dict[str, tuple[float, int]] = {}
        self._phase_started: float | None = None  # when the span under way began

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        device = trainer.strategy.root_device
        if device.type == "cuda":
            self._sync = lambda: torch.cuda.synchronize(device)
            self.release = torch.cuda.empty_cache
            if self.stats is None:
                self.stats = (lambda: (torch.cuda.max_memory_allocated(device),
                                       torch.cuda.max_memory_reserved(device)),
                              lambda: torch.cuda.reset_peak_memory_stats(device))

    # -------------------------------------------------------------------------------------------- memory
    def _close(self, phase: str | None) -> None:
        """The span that ends here belongs to ``phase`` (None: to none), its peaks and its wall time; the next one
        starts."""
        self._sync()  # at a phase's bounds only (never between steady steps): the device's own time in the span
        now = time.perf_counter()
        if phase in TIMED_PHASES and self._phase_started is not None:
            seconds, spans = self.phase_s.get(phase, (0.0, 0))
            self.phase_s[phase] = (seconds + now - self._phase_started, spans + 1)
        self._phase_started = now
        if self.stats is None:
            return
        read, reset = self.stats
        if phase is not None:
            allocated, reserved = (int(v) for v in read())
            old = self.peaks.get(phase, (0, 0))
            self.peaks[phase] = (max(old[0], allocated), max(old[1], reserved))
            if phase in ("training_step1", "training") and not self._validated:
                self.first_training_reserved = max(self.first_training_reserved or 0, reserved)
        reset()

    # -------------------------------------------------------------------------------------------- time
    def _start_timing(self, trainer: L.Trainer) -> None:
        if self._steps_done >= TIMED_AFTER_STEPS and self._span is None:
            self._sync()
            self._span = (time.perf_counter(), trainer.global_step)

    def _stop_timing(self, trainer: L.Trainer) -> None:
        if self._span is not None:
            self._sync()
            started, step = self._span
            self.timed_s += time.perf_counter() - started
            self.timed_steps += trainer.global_step - step
            self._span = None

    # -------------------------------------------------------------------------------------------- hooks
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.release is not None:  # the sanity check's cached segments: not the training step's
            self.release()
        self._close(None)  # what came before (the sanity check, loading) is no phase

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._steps_done += 1
        if self._steps_done == 1:
            self._close("training_step1")
        if self._steps_done == TIMED_AFTER_STEPS:
            self._start_timing(trainer)

    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._stop_timing(trainer)
        self._close(None if trainer.sanity_checking else "training")
        self._validated = self._validated or not trainer.sanity_checking
        self._sampled_at = getattr(pl_module, "_last_sampled_step", None)

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._close(None if trainer.sanity_checking else "validation")

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        sampled = getattr(pl_module, "_last_sampled_step", None) != self._sampled_at
        self._close("sampling" if sampled and not trainer.sanity_checking else None)
        if not trainer.sanity_checking:
            self._start_timing(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # before the system's own on_train_end, which may write the final samples
        self._stop_timing(trainer)
        self._close("training" if self._steps_done else None)
        self._sampled_at = getattr(pl_module, "_last_sampled_step", None)

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if getattr(pl_module, "_last_sampled_step", None) != self._sampled_at:
            self._close("sampling")
        if not self.peaks and not self.timed_steps and not self.phase_s:
            return
        record = self.record()
        if trainer.is_global_zero:
            print(f"[voxdiff] measured on {trainer.strategy.root_device}: {self.summary()}", flush=True)
            metrics = {f"memory/{k}_gib": v for k, v in record["memory"]["measured_gib"].items()}
            if record["step_time"] is not None:
                metrics["time/step_ms"] = record["step_time"]["measured_ms"]
            metrics.update({f"time/{phase}_s": t["mean_s"] for phase, t in record["phase_time"].items()})
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)
        if self.out_dir is not None:
            rank = trainer.global_rank
            name = "measured.json" if rank == 0 else f"measured.rank{rank}.json"
            device = trainer.strategy.root_device
            where = {"device": str(device),
                     "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
            text = json.dumps({**record, **where, **self.context}, indent=1, default=str) + "\n"
            atomic_write(self.out_dir / name, lambda f: f.write(text.encode()))

    # -------------------------------------------------------------------------------------------- report
    def record(self) -> dict[str, Any]:
        """``memory``: the measured peaks (GiB: ``<phase>`` allocated, ``<phase>_reserved``, and
        ``training_before_validation_reserved``), the prediction, and the error of each predicted phase
        (``(predicted - measured) / measured``): the allocated peak's, and with CUDA graphs (a ``graph_pool``
        predicted) the training step's reserved one (before the first validation, where measured) against
        ``training_reserved``.
        ``step_time``: ``measured_ms`` over ``steps``, ``predicted_ms`` and its ``error`` (None: no step timed).
        ``phase_time``: for each phase of :data:`TIMED_PHASES` measured, its ``total_s`` over its ``spans`` (one per
        validation, per sampling) and ``mean_s``, the seconds of one."""
        measured: dict[str, float] = {}
        for phase in MEASURED_PHASES:
            if phase in self.peaks:
                allocated, reserved = self.peaks[phase]
                measured[phase], measured[f"{phase}_reserved"] = allocated / 2**30, reserved / 2**30
        if self.first_training_reserved is not None:
            measured["training_before_validation_reserved"] = self.first_training_reserved / 2**30
        errors = {}
        graphs = bool(self.predicted.get("graph_pool"))
        for phase in ("training", "validation", "sampling"):
            if phase in measured and phase in self.predicted and measured[phase] > 0 and not (
                    graphs and phase == "training"):
                errors[phase] = (self.predicted[phase] - measured[phase]) / measured[phase]
        step_reserved = measured.get("training_before_validation_reserved", measured.get("training_reserved"))
        if graphs and step_reserved and self.predicted.get("training_reserved"):
            errors["training_reserved"] = (self.predicted["training_reserved"] - step_reserved) / step_reserved
        step = None
        if self.timed_steps:
            ms = self.timed_s / self.timed_steps * 1e3
            step = {"measured_ms": ms, "steps": self.timed_steps, "predicted_ms": self.predicted_step_ms,
                    "error": None if self.predicted_step_ms is None else (self.predicted_step_ms - ms) / ms}
        phases = {phase: {"total_s": seconds, "spans": spans, "mean_s": seconds / spans}
                  for phase, (seconds, spans) in self.phase_s.items()}
        return {"memory": {"measured_gib": measured, "predicted_gib": self.predicted, "error": errors},
                "step_time": step, "phase_time": phases}

    def summary(self) -> str:
        """One line: each phase's measured peaks and the step time, with the prediction and its error where there
        is one."""
        record = self.record()
        measured, errors = record["memory"]["measured_gib"], record["memory"]["error"]
        parts = []
        for phase in MEASURED_PHASES:
            if phase not in measured:
                continue
            text = f"{phase} {measured[phase]:.2f} GiB allocated"
            if phase in errors:
                text += f" (predicted {self.predicted[phase]:.2f}, {errors[phase]:+.1%})"
            text += f", {measured[f'{phase}_reserved']:.2f} reserved"
            if phase == "training" and "training_reserved" in errors:
                before = measured.get("training_before_validation_reserved")
                text += (f" ({before:.2f} before the first validation; " if before is not None else " (") + (
                    f"predicted {self.predicted['training_reserved']:.2f} with the CUDA graphs' pool, "
                    f"{errors['training_reserved']:+.1%})")
            parts.append(text)
        step = record["step_time"]
        if step is not None:
            text = f"step {step['measured_ms']:.1f} ms over {step['steps']} steps"
            if step["predicted_ms"] is not None:
                text += f" (predicted {step['predicted_ms']:.1f}, {step['error']:+.1%})"
            parts.append(text)
        parts += [f"{TIMED_PHASES[phase]} {t['mean_s']:.3g} s"
                  + (f" a time over {t['spans']}" if t["spans"] > 1 else "") for phase, t in record["phase_time"].items()]
        return "; ".join(parts)
