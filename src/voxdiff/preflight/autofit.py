"""The preflight chooses: the batch size and gradient-checkpointing policy that train fastest within the budget.

:func:`autofit` predicts candidates of one configuration, each a :func:`~voxdiff.preflight.check.run_preflight`
of the config with its overrides (the whole run's peak: training, validation, sampling; disk and host memory), and
ranks those that fit by **samples per second**: ``batch x GPUs / step time``, the step time from the time model
(:data:`~voxdiff.preflight.resources.STEP_THROUGHPUT`: ``tflop / tflops + ops x op_us``, and for the CUDA-graph step
the bytes its operators touch). A larger batch adds FLOPs and traffic but few operator calls, so a launch-bound step
(exp11: ~3% of an H100's dense bf16 peak at batch 1) gains samples per second with the batch until its traffic
dominates (exp11 on an H100: about 70 samples/s predicted at any batch from 32, 2.1x batch 1's), and a FLOP-bound
one little.

The search:

* batch sizes 1, 2, 4, ... up to ``preflight.max_batch_size``, per policy until the first that does not fit (a
  larger one needs more memory);
* gradient checkpointing ``none``, then ``block`` and ``layer`` only from the batch ``none`` no longer fits: at a
  batch that fits without it, checkpointing only recomputes (more FLOPs and calls, the same samples), so it is never
  faster there;
* compile on for a run that does not compile, where the GPU's throughput was measured for both kinds (memory: the
  run's eager trace, an upper bound of the compiled step's; time: each kind's own throughput); compiled in the run's
  ``model.compile_mode``, whose ``auto`` takes CUDA graphs (their own throughput) for a candidate without gradient
  accumulation on one GPU. Compile off is never offered to a run that compiles: on every experiment measured (one
  H100, batch 1, ``reference/h100_step_times.csv``) the compiled step was 1.18-1.55x faster than the eager one,
  and inductor's fusions save more at a larger batch, not less (until session 24 the two kinds' constants, fitted to
  different steps at batch 1, put the eager step of exp9 ahead by 2-18% at batches 2 to 32, an artefact of the fits;
  with the CUDA-graph step's byte terms the compiled rows lead at every batch);
* with ``preflight.effective_batch=N`` only batches that divide it (per GPU x GPUs), the rest made up by
  ``trainer.accumulate_grad_batches``: the optimisation sees the same batch;
* the EMA interval (``system.ema.every_n_steps``): where the run sets a shorter one than ``auto`` would take for
  its decay (:func:`voxdiff.step.ema.auto_interval`: at least 100 updates per horizon ``1 / (1 - decay)``, at most
  every 10th step; ``decay`` raised to the interval keeps the horizon), each candidate of the run's compile kind also
  with that interval, if it saves at least :data:`EMA_MIN_GAIN` of the step (the EMA's share is large for a large
  model at a small batch: 2.7B parameters). ``auto``, the default, takes it already. Same memory; the time model
  counts the EMA's pass over the weights in bytes at the GPU's bandwidth
  (:class:`~voxdiff.preflight.resources.StepCost`), so these rows differ from their twins by that arithmetic alone;
* not searched: compile modes other than the run's (a mode is chosen by ``model.compile_mode``, not by the batch);
  the memory layout (``model.channels_last``, ``auto``: channels-last for a compiled GPU run): the time model was
  fitted to NCDHW steps only, so a channels-last run's times are NCDHW's, and the report says
  so (:func:`layout_note`).

A candidate fits when its GPU and host memory do; a misfit no batch changes (the checkpoints' disk under
``paths.run_dir``) is a note of the report, and the check of the chosen configuration refuses the run for it. A
candidate's samples per second count the wait for data
(:func:`~voxdiff.preflight.resources.data_step_s`: the loader's measured rate,
:func:`~voxdiff.preflight.resources.loader_rate`): with DataLoader workers, a loader slower than the step caps it;
with none, the main process loads each batch between steps, which adds to every step. Where that costs more than
:data:`~voxdiff.preflight.resources.DATA_SLACK` of a step the candidate is marked ``data``; among candidates the
loader caps alike, the least memory wins the tie.

Where the GPU type has no measured throughput (and on a CPU run, against the host's memory), the choice is by
memory alone: the largest batch that fits, without checkpointing where possible. Each candidate is predicted as the
run will step, by the same verdict ``train.py`` uses on a GPU and the check of the chosen one: a compiled run's
candidates without checkpointing are traced compiled (the compiled profile, cached per UNet and input shape under
:func:`~voxdiff.preflight.compiled.cache_dir`: about 15-20 s a shape the first time on a CPU, then seconds), with CUDA
graphs as two allocator pools; checkpointed ones, which the compiled trace does not model, eagerly (an upper bound).
The eager trace of a CUDA-graph run puts its whole eager forward and backward in the graphs' pool beside validation,
far above the step that runs (exp11 at batch 32 on an H100: 120.0 GiB needed against 67.2 compiled), so an eager
choice took smaller batches than ``train.py``'s.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from omegaconf import DictConfig

from voxdiff.config import model_spec, select
from voxdiff.errors import ConfigError
from voxdiff.models.checkpointing import GRANULARITIES
from voxdiff.models.unet import CUDAGRAPH_MODES
from voxdiff.preflight.check import PreflightResult, override_args, run_preflight, with_overrides
from voxdiff.preflight.memory import traced_recipe
from voxdiff.preflight.resources import (
    CHANNELS_LAST_TIME,
    STEP_THROUGHPUT,
    data_step_s,
    loader_table,
    split_sizes,
    step_kind,
    waits_for_data,
)
from voxdiff.preflight.world import PREDICTED_DEVICE
from voxdiff.run.spec import RunSpec, run_spec
from voxdiff.step import EMASettings
from voxdiff.step.ema import SAMPLES_PER_HORIZON, auto_interval

__all__ = ["AutofitReport", "Candidate", "autofit"]

EMA_MIN_GAIN = 0.02
"""The least share of a step the longer EMA interval must save to be offered (a change to the average for less is
not worth it)."""
NEAR_BEST = 0.90
"""A candidate predicted at this share of the chosen one's samples per second or more, with less memory, is named
in a note (:meth:`AutofitReport.nearly_as_fast`): the time model's error above batch 1 is larger than the gap."""


@dataclass(frozen=True)
class Candidate:
    """One configuration the choice predicted.

    Attributes:
        settings: the config keys it sets and their values (``{"data.batch_size": 8, ...}`` as pairs).
        batch_size: volumes per batch and GPU.
        checkpointing: ``model.gradient_checkpointing``.
        compile: ``model.compile``.
        peak_gib: the run's predicted per-GPU peak (the largest of its phases; a compiled run's checkpointed
            candidate: its eager trace's, an upper bound).
        peak_phase: which phase sets it (training, validation, sampling).
        need_gib: the peak with the safety margin and the CUDA context, against the budget.
        fits: need <= budget, and its host memory fits (the disk, the same at every batch, is left to the check
            of the chosen one).
        step_ms: predicted milliseconds per step (None: no measured throughput for this GPU and step kind).
        samples_per_s: ``batch x GPUs / step`` (None without a step time), the step with its wait for data
            (``data_bound``: the wait costs more than ``DATA_SLACK`` of it; :func:`voxdiff.preflight.resources.
            data_step_s`).
        ema_every_n_steps: the EMA's interval (``system.ema.every_n_steps``); None: no EMA.
    """

    settings: tuple[tuple[str, Any], ...]
    batch_size: int
    checkpointing: str
    compile: bool
    peak_gib: float
    peak_phase: str
    need_gib: float
    fits: bool
    step_ms: float | None
    samples_per_s: float | None
    ema_every_n_steps: int | None = None
    data_bound: bool = False

    @property
    def overrides(self) -> tuple[str, ...]:
        """The settings as a command line takes them (``data.batch_size=8 model.gradient_checkpointing=none``)."""
        return tuple(override_args(self.settings))


@dataclass
class AutofitReport:
    """The candidates of one configuration and the one chosen (:func:`autofit`)."""

    name: str
    gpu: str
    budget_gib: float
    budget_source: str
    by: str  # "samples per second" or "memory alone"
    candidates: list[Candidate] = field(default_factory=list)
    best: Candidate | None = None
    notes: list[str] = field(default_factory=list)

    def nearly_as_fast(self) -> Candidate | None:
        """The fitting candidate with the least memory among those predicted at :data:`NEAR_BEST` of the chosen
        one's samples per second or more that need less memory than it (None: there is none, or no step times).
        Where samples per second saturate with the batch (a FLOP-bound step), it trains about as fast with far
        less memory, and changes the optimisation less."""
        best = self.best
        if best is None or not best.samples_per_s:
            return None
        near = [c for c in self.candidates if c.fits and c.samples_per_s is not None and c.need_gib < best.need_gib
                and c.samples_per_s >= NEAR_BEST * best.samples_per_s]
        return min(near, key=lambda c: (c.need_gib, -c.samples_per_s), default=None)

    def table(self) -> str:
        """The candidates as a text table, the chosen one marked ``*``, then the notes."""
        head = (f"batch-size choice for {self.name} on {self.gpu} ({self.budget_gib:.1f} GiB, {self.budget_source}); "
                f"chosen by {self.by}")
        lines = [head, f"  {'':1} {'batch':>5} {'checkpointing':>13} {'compile':>7} {'EMA every':>9} {'peak GiB':>9} "
                       f"{'need GiB':>9} {'ms/step':>8} {'samples/s':>14}  overrides"]
        for c in self.candidates:
            mark = "*" if c is self.best else ("" if c.fits else "✗")
            ms = f"{c.step_ms:.0f}" if c.step_ms is not None else "-"
            sps = f"{c.samples_per_s:.2f}" if c.samples_per_s is not None else "-"
            sps += " data" if c.data_bound else ""
            ema = str(c.ema_every_n_steps) if c.ema_every_n_steps is not None else "-"
            lines.append(f"  {mark:1} {c.batch_size:>5} {c.checkpointing:>13} {str(c.compile).lower():>7} {ema:>9} "
                         f"{c.peak_gib:>9.2f} {c.need_gib:>9.2f} {ms:>8} {sps:>14}  {' '.join(c.overrides)}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


#: how one candidate is predicted: the config with its overrides → the preflight's result (``train.py`` passes its
#: own, against the machine it runs on)
Verdict = Callable[[DictConfig], PreflightResult]


def autofit(cfg: DictConfig, verdict: Verdict | None = None, run: RunSpec | None = None,
            progress: Callable[[str], None] | None = None) -> AutofitReport:
    """Predict the candidates of ``cfg`` and choose the fastest that fits (see the module docstring).

    Args:
        cfg: the composed config (``data.batch_size`` may be ``auto`` or a number: it is replaced per candidate).
        verdict: predicts one candidate's config; by default the GPU preflight's prediction of the step the
            run takes (``run_preflight(..., suggest=False)``: compiled where the run compiles; ``train.py`` passes
            its own, against the machine it runs on).
        run: the run spec of ``cfg`` at batch 1, for its GPU and GPU count (default: resolved for a GPU).
        progress: called with one line per candidate predicted (its batch, checkpointing, need against the budget,
            the step it was predicted as and the seconds it took): a compiled trace takes 15-20 s the first time,
            and ``train.py`` and ``preflight.py`` print each line as it comes, so a long choice is not a silent one.

    Returns:
        The report; ``best`` is None when no candidate fits (the notes say what was tried).

    Raises:
        ConfigError: a problem of the config that no batch size changes (the first candidate's).
    """
    verdict = verdict or (lambda c: run_preflight(c, suggest=False))
    one = with_overrides(cfg, {"data.batch_size": 1})
    run = run or run_spec(one, PREDICTED_DEVICE)
    if run.kind != "diffusion":
        raise ConfigError("data.batch_size", select(cfg, "data.batch_size"), "the preflight chooses the batch of a "
                          "diffusion run only; a VQ-VAE stage 1's step is not predicted per batch",
                          "give a number, e.g. data.batch_size=1")
    options, world = run.preflight, run.parallel.world_size
    compile_now = bool(run.unet.compile) if run.unet is not None else False
    on_gpu = run.device_type == "cuda"
    # the other kind only to turn compile on (see the module docstring: off is never faster where measured)
    kinds = [compile_now] + ([True] if not compile_now and on_gpu and all((run.gpu.name, k) in STEP_THROUGHPUT
                                                                          for k in ("eager", "compiled")) else [])
    ema = traced_recipe(run).ema
    ema_now = ema.every_n_steps if ema is not None else None
    ema_other, ema_why_not = _ema_interval(ema)
    data = run.resources.data
    sizes = split_sizes(data)  # a batch larger than the training split is not a batch
    training = sizes[0] if sizes is not None else None
    cap = min(options.max_batch_size, training) if training else options.max_batch_size
    batches = [b for b in (2**i for i in range(16)) if b <= cap]
    if options.effective_batch is not None:
        batches = [b for b in batches if options.effective_batch % (b * world) == 0]
        if not batches:
            raise ConfigError("preflight.effective_batch", options.effective_batch, f"no batch of 1 to {cap} per GPU "
                              f"times {world} GPU(s) divides it, so gradient accumulation cannot make it up",
                              f"give a multiple of {world}, e.g. preflight.effective_batch={8 * world}")
    report: AutofitReport | None = None
    first_misfit: int | None = None
    batch_free: dict[str, str] = {}  # what does not fit at any batch, per key (refused after the choice)
    data_cap: float | None = None  # the loader's volumes/s per GPU where waiting for it costs a candidate time
    workers = int(run.resources.num_workers)
    for policy in GRANULARITIES:
        start = 1 if policy == "none" else first_misfit
        if start is None:  # every batch fits without checkpointing: checkpointing would only be slower
            break
        for b in (b for b in batches if b >= start):
            overrides: dict[str, Any] = {"data.batch_size": b, "model.gradient_checkpointing": policy}
            if options.effective_batch is not None:
                overrides["trainer.accumulate_grad_batches"] = options.effective_batch // (b * world)
            candidate = with_overrides(cfg, overrides)
            started = time.monotonic()
            result = verdict(candidate)
            if result.problems:
                raise result.problems[0]
            if progress is not None:
                step = result.report.model_step if result.report is not None else "not traced"
                progress(f"batch {b}, gradient checkpointing {policy}: needs {result.need_gib:.1f} GiB of "
                         f"{result.budget_gib:.1f} ({'fits' if result.fits else 'does not fit'}; {step} step, "
                         f"predicted in {time.monotonic() - started:.0f} s)")
            if report is None:
                report = AutofitReport(result.name, run.gpu.name if on_gpu else "the CPU", result.budget_gib,
                                       result.budget_source,
                                       "samples per second" if result.needs is not None and result.needs.step_s
                                       is not None else "memory alone")
            fits, unchosen = _fits(result)
            for m in unchosen:  # once per key (a dated run directory may differ by a second between candidates)
                batch_free.setdefault(m.key, str(m))
            # the compile mode this candidate's run resolves to (auto: CUDA graphs unless it accumulates)
            graphs = model_spec(candidate, run.encoding, run.device_type).compile_mode in CUDAGRAPH_MODES
            for compiled in kinds:
                kind = step_kind(compiled, graphs)
                shown = {**overrides, "model.compile": compiled} if compiled != compile_now else overrides
                step_s = _step_s(result, run.gpu.name, kind)
                rows = [(ema_now, shown, step_s)]
                if ema_other is not None and compiled == compile_now and step_s is not None:
                    other_s = _step_s(result, run.gpu.name, kind, ema_other)
                    if other_s <= (1 - EMA_MIN_GAIN) * step_s:
                        rows.append((ema_other, {**shown, "system.ema.every_n_steps": ema_other}, other_s))
                loader = result.needs.loader_per_s if result.needs is not None else None
                for interval, settings, step_s in rows:
                    wall_s = data_step_s(step_s, b, loader, workers)
                    bound = waits_for_data(step_s, wall_s)
                    report.candidates.append(Candidate(
                        tuple(settings.items()), b, policy, compiled,
                        result.per_gpu_peak_gib, result.peak_phase, result.need_gib, fits,
                        None if step_s is None else step_s * 1e3, None if wall_s is None else b * world / wall_s,
                        interval, bound))
                    if bound:
                        data_cap = loader
            if not fits:
                if policy == "none":
                    first_misfit = b
                break
    assert report is not None  # batch 1 is always tried
    fitting = [c for c in report.candidates if c.fits]
    if report.by == "samples per second":
        report.best = max(fitting, key=lambda c: (c.samples_per_s or 0.0, -c.peak_gib), default=None)
    else:  # memory alone: the largest batch that fits, the least recomputation
        report.best = max(fitting, key=lambda c: (c.batch_size, -GRANULARITIES.index(c.checkpointing)), default=None)
    offered = any(c.ema_every_n_steps != ema_now for c in report.candidates)
    why_not = ema_why_not or f"every {ema_other} steps would save less than {EMA_MIN_GAIN:.0%} of a step here"
    _notes(report, options.effective_batch, world, first_misfit, bool(kinds[1:]),
           _ema_note(ema, ema_other) if offered else f"not searched: system.ema.every_n_steps ({why_not})",
           compiled_run=compile_now, layout=layout_note(run.unet.channels_last is True))
    if data_cap is not None:
        cache = str(data.get("cache", "memory"))
        how = ("the main process loads each batch between steps, which adds to every step" if workers == 0 else
               "a larger batch would wait for data, so among the candidates it caps alike the choice is the least "
               "memory")
        more = "more data.num_workers (they load the next batches while the GPU runs)"
        table = loader_table(data)  # a rate came from it
        report.notes.append(
            f"samples/s marked 'data' count the wait for data: the loader delivers about {data_cap:.1f} volumes/s "
            f"per GPU with data.cache={cache} and data.num_workers={workers} ({table.source if table else '?'}); "
            f"{how}. Fix: " + (more if cache == "memory" else f"data.cache=memory (checked against host memory), or "
                                                              f"{more}"))
    report.notes += [f"does not fit at any batch, so it does not decide the choice (the check of the chosen one "
                     f"refuses the run for it): {m}" for m in batch_free.values()]
    report.notes.append(f"batches tried: {', '.join(map(str, batches))} (up to preflight.max_batch_size="
                        f"{options.max_batch_size}" + (f" and the {training} training subjects of the data set)"
                                                       if training else ")"))
    return report


BATCH_FREE_KEYS = ("paths.run_dir",)
"""Keys of misfits no batch changes: the checkpoints' disk (its size is the weights', the EMA's and AdamW's)."""


def _fits(result: PreflightResult) -> tuple[bool, list[ConfigError]]:
    """Whether a candidate fits as far as its batch and checkpointing decide (the GPU's memory, the host's), and the
    misfits that are the same for every candidate (:data:`BATCH_FREE_KEYS`), which the choice leaves to the check
    of the chosen one: were they counted, no candidate would fit and the report would choose none."""
    return (result.ok_apart_from(BATCH_FREE_KEYS),
            [m for m in result.misfits if m.key in BATCH_FREE_KEYS])


def _ema_interval(ema: EMASettings | None) -> tuple[int | None, str]:
    """The EMA interval to offer beside the run's (``auto``'s for its decay), or None and why not."""
    if ema is None:
        return None, "the run has no EMA"
    interval = auto_interval(ema.decay)
    if interval == 1:
        return None, (f"the EMA's horizon of {1 / (1 - ema.decay):.0f} steps (system.ema.decay={ema.decay:g}) is "
                      f"too short to average less often than every step: fewer than {2 * SAMPLES_PER_HORIZON}")
    if ema.every_n_steps >= interval:
        return None, f"it is {ema.every_n_steps} already; auto gives {interval} for system.ema.decay={ema.decay:g}"
    return interval, ""


def _ema_note(ema: EMASettings, interval: int) -> str:
    """The report's note on the EMA-interval rows it offers."""
    return (f"system.ema.every_n_steps={interval} rows: the EMA averages every {interval}th optimizer step with "
            f"decay**{interval}, the same horizon of {1 / (1 - ema.decay):.0f} steps (system.ema.decay={ema.decay:g}); "
            "their time differs by the EMA's pass over the weights (12 bytes per parameter at the GPU's copy "
            "bandwidth: arithmetic, not measured)")


def _step_s(result: PreflightResult, gpu: str, kind: str, ema_every_n_steps: int | None = None) -> float | None:
    """The candidate's predicted seconds per step; with ``ema_every_n_steps``, at that EMA interval."""
    needs = result.needs
    throughput = STEP_THROUGHPUT.get((gpu, kind))
    if needs is None or needs.cost is None or throughput is None:
        return None
    cost = needs.cost
    if ema_every_n_steps is not None and cost.ema_every_n_steps is not None:
        cost = replace(cost, ema_every_n_steps=ema_every_n_steps)
    return throughput.seconds(cost)


def layout_note(channels_last: bool) -> str:
    """What the step times say of the memory layout (``channels_last``: the run's, as it resolves on the GPU): a
    channels-last run's are NCDHW's (the time model was fitted to NCDHW steps:
    :data:`~voxdiff.preflight.resources.STEP_THROUGHPUT`), and the layout is not among the candidates. Its GPU figures
    (``reference/README.md``): whole compiled steps at batch 1 (exp11 0.96x the NCDHW step's time on an H100,
    session 15, 0.97x on an H200, session 31; exp9_ldm_8x_bravo at most 0.94x on an H200, session 26) and at exp11's
    batch 32 (1.01x on an H200, session 31), where the convolutions alone took 0.758x (``bench/bench_convs.py``,
    session 25; exp9_ldm_4x_bravo's at batch 2 0.816x)."""
    measured = ("compiled channels-last steps measured at batch 1 ran 0.96-0.97x (exp11, H100 and H200) and at "
                "most 0.94x (exp9_ldm_8x_bravo, H200) the NCDHW step's time, at exp11's batch 32 1.01x (H200), "
                "although its convolutions alone took 0.76x (bench/bench_convs.py)")
    if channels_last:
        return f"channels-last (model.channels_last): the step times above are {CHANNELS_LAST_TIME} ({measured})"
    return f"not searched: model.channels_last ({measured})"


def _notes(report: AutofitReport, effective: int | None, world: int, first_misfit: int | None,
           both_kinds: bool, ema_note: str, compiled_run: bool = False, layout: str | None = None) -> None:
    """``ema_note``: the EMA interval's note (rows offered, or why none was); ``compiled_run``: the run compiles
    its model (its checkpointed rows are eager upper bounds); ``layout``: :func:`layout_note`, given where the
    candidates have step times."""
    notes = report.notes
    if report.best is None:
        notes.append("no candidate fits: see python preflight.py experiment=... for the fixes of batch 1")
    if report.by == "memory alone" and report.gpu == "the CPU":
        notes.append("a CPU run: the time model is a GPU's, so the choice is by memory alone (the host's): the "
                     "largest batch that fits")
    elif report.by == "memory alone":
        notes.append(f"the step's speed on {report.gpu} has not been measured (STEP_THROUGHPUT), so the choice is "
                     "by memory alone: the largest batch that fits")
    else:
        notes.append("step times from the time model (README: its errors). The CUDA-graph step's: fitted to eleven "
                     "H100 rows, two above batch 1 (exp11 at batch 32: -7.6%, -17.7% leave-one-out; exp9_ldm_4x_bravo "
                     "at batch 2: +3.1%, +5.3%), and checked on four H200 rows it was not fitted to (+1.7% to +17.8%; "
                     "exp9_ldm_4x_bravo at batch 4 +5.8%) and four channels-last ones (exp11 at batch 32 +0.9%, at "
                     "batch 1 +18.1% to +27.4%: predicted long). The "
                     "eager and compiled steps': FLOPs and operator calls fitted at batch 1 only, so their large "
                     "batches are predicted short. Each GPU run writes its own to measured.json "
                     "(bench/fit_step_time.py --runs)")
    near = report.nearly_as_fast()
    if near is not None and report.best is not None and report.best.samples_per_s:
        notes.append(f"nearly as fast with less memory: {' '.join(near.overrides)} is predicted at "
                     f"{near.samples_per_s / report.best.samples_per_s:.0%} of the chosen samples/s and needs "
                     f"{near.need_gib:.1f} GiB against {report.best.need_gib:.1f}: within the time model's error above "
                     "batch 1, with room for what the memory estimate misses at a large batch (a CUDA-graph step at "
                     "batch 32 reserved 17% above its estimate on an H100), and a smaller change to the optimisation")
    if first_misfit is None:
        notes.append("every batch tried fits without gradient checkpointing, so checkpointing (only slower at the "
                     "same batch) is not listed")
    if both_kinds:
        notes.append("model.compile=true rows: memory of the eager trace, an upper bound of the compiled step's")
    if compiled_run and any(c.checkpointing != "none" for c in report.candidates):
        notes.append("rows with gradient checkpointing: memory of the eager trace (the compiled trace does not model "
                     "checkpointing), an upper bound of the compiled step's; with CUDA graphs a loose one (the "
                     "eager forward and backward counted as the graphs' pool)")
    if effective is not None:
        notes.append(f"the effective batch is held at {effective} samples per optimizer step (batch x {world} GPU(s) "
                     "x trainer.accumulate_grad_batches)")
    elif report.best is not None and report.best.batch_size > 1:
        notes.append(f"a batch of {report.best.batch_size} changes the optimisation as well as the speed: each "
                     "optimizer step averages more samples (consider scaling system.optim.lr, or hold the effective "
                     "batch with +preflight.effective_batch=N, made up by gradient accumulation)")
    notes.append(ema_note)
    notes.append("not searched: compile modes other than the run's model.compile_mode (auto: CUDA graphs on one GPU "
                 "without gradient accumulation)")
    if layout is not None and report.by == "samples per second":
        notes.append(layout)
