"""The preflight's verdict on one configuration: every configuration problem, then whether the run fits its GPU,
its disk and its nodes' memory, and fixes where it does not.

:func:`run_preflight` (``preflight.py``) resolves the run spec once (:func:`voxdiff.run.spec.run_spec_problems`, for
the GPU predicted: :data:`~voxdiff.preflight.world.PREDICTED_DEVICE`), then reads everything from it: the training
step's peak (:func:`voxdiff.preflight.memory.predict_memory`), validation and sampling
(:func:`voxdiff.preflight.memory.predict_phases`) or a stage 1 (:func:`voxdiff.preflight.stage1.predict_stage1`),
disk, host memory and time (:func:`voxdiff.preflight.resources.run_needs`); the verdict is on the largest peak
against the GPU's budget. A config that does not fit gets fixes, each a config override resolved into a spec of its
own and traced eagerly (an upper bound of its compiled step). :func:`training_verdict` runs the same for
``train.py`` on the machine it starts on. Nothing here needs a GPU: ~1 s per configuration on a laptop CPU (more
when it suggests fixes, 10-25 s for a compiled step's first trace).
"""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from voxdiff.config import Shapes, select
from voxdiff.encodings.vqvae import build_vqvae
from voxdiff.errors import ConfigError
from voxdiff.preflight.memory import (
    DEFAULT_SAFETY_MARGIN,
    MemoryReport,
    PhasesReport,
    predict_memory,
    predict_phases,
    traced_recipe,
    traced_unet,
)
from voxdiff.preflight.resources import (
    DataMemory,
    RunNeeds,
    StepCost,
    data_memory,
    gradient_pass_bytes,
    host_memory_bytes,
    run_needs,
    step_cost,
    step_kind,
)
from voxdiff.preflight.stage1 import Stage1Report, predict_stage1
from voxdiff.preflight.world import PREDICTED_DEVICE
from voxdiff.run.gpus import DEFAULT_GPU, GPUS, GpuSpec
from voxdiff.run.spec import Parallel, RunSpec, run_spec, run_spec_problems
from voxdiff.units import GiB


def gpu_budget_gib(run: RunSpec) -> tuple[float, str]:
    """The memory budget per GPU of ``run`` and where it comes from: ``preflight.gpu_memory_gib``, else the memory
    of its GPU type (:func:`~voxdiff.run.gpus.resolve_gpu`)."""
    if run.preflight.gpu_memory_gib is not None:
        return run.preflight.gpu_memory_gib, "preflight.gpu_memory_gib"
    source = "default GPU" if run.gpu_source == "default" else run.gpu_source
    return run.gpu.total_gib, f"{source} {run.gpu.name}"


@dataclass
class Suggestion:
    """A change that makes a config fit (or not), with its predicted peak."""

    change: str
    overrides: list[str]
    peak_gib: float
    need_gib: float
    fits: bool


@dataclass
class PreflightResult:
    """Everything the preflight found about one configuration."""

    name: str
    problems: list[ConfigError]
    shapes: Shapes | None = None
    levels: int = 0
    params: int = 0
    report: MemoryReport | None = None
    strategy: str = "single"  # single | ddp | fsdp (voxdiff.run.spec.parallel_of)
    world_size: int = 1
    per_gpu_peak_gib: float = 0.0  # predicted max_memory_allocated of one GPU (one rank of DDP/FSDP)
    need_gib: float = 0.0  # per_gpu_peak * (1 + margin) + CUDA context
    margin: float = DEFAULT_SAFETY_MARGIN  # the safety margin need_gib was computed with
    budget_gib: float = GPUS[DEFAULT_GPU].total_gib
    budget_source: str = "default"
    gpu: GpuSpec | None = None  # the GPU predicted for (voxdiff.run.gpus.resolve_gpu)
    parallel: Parallel | None = None  # the strategy the trace is of (one rank of it)
    data: DataMemory | None = None  # host memory of the data module per rank (data.cache=memory, latents)
    fits: bool = False
    suggestions: list[Suggestion] = field(default_factory=list)

    modelled: bool = True  # False for systems whose step the preflight does not trace
    suggestions_step: str = ""  # how the fixes' steps were predicted (``eager``)
    phases: PhasesReport | None = None  # a diffusion run's training, validation and sampling peaks
    stage1: Stage1Report | None = None  # a stage-1 run's VQ-VAE step and latent-cache pass
    peak_phase: str = "training"  # the phase whose peak is the run's (the verdict is on it)
    needs: RunNeeds | None = None  # disk, host memory, time (voxdiff.preflight.resources)

    def predicted_phases_gib(self) -> dict[str, float]:
        """The predicted peaks a run's measurement is held against (GiB; :class:`voxdiff.lightning.callbacks.
        MeasuredRun`): ``training`` (allocated) and ``training_reserved``, ``graph_pool`` with CUDA graphs, and
        ``validation`` and ``sampling`` (allocated) where predicted. Empty for a run not predicted."""
        if self.report is None:
            return {}
        out = {"training": self.report.peak_allocated / GiB, "training_reserved": self.report.estimated_reserved / GiB}
        if self.report.graph_pool_bytes:
            out["graph_pool"] = self.report.graph_pool_bytes / GiB
        if self.phases is not None:
            out["validation"], out["sampling"] = self.phases.validation / GiB, self.phases.sampling / GiB
        return out

    @property
    def misfits(self) -> tuple[ConfigError, ...]:
        """What besides GPU memory does not fit (disk, host memory), each naming the key, the value and a fix."""
        return self.needs.misfits if self.needs is not None else ()

    @property
    def ok(self) -> bool:
        return self.ok_apart_from(())

    def ok_apart_from(self, keys: tuple[str, ...]) -> bool:
        """:attr:`ok`, leaving out the misfits of these config keys (``("paths.run_dir",)``: the disk)."""
        return (not self.problems and (self.fits or not self.modelled)
                and all(m.key in keys for m in self.misfits))


def _need(peak_bytes: float, report: MemoryReport, margin: float) -> float:
    return report.need_bytes(peak_bytes, margin) / GiB


def with_overrides(cfg: DictConfig, overrides: dict[str, Any]) -> DictConfig:
    """A copy of ``cfg`` with each dotted key set to its value (added where absent)."""
    new = copy.deepcopy(cfg)
    for key, value in overrides.items():
        OmegaConf.update(new, key, value, merge=False, force_add=True)
    return new


def override_args(settings: Iterable[tuple[str, Any]]) -> list[str]:
    """``(key, value)`` pairs as a command line takes them: ``model.compile=true``, ``model.channels=[64,128]``."""
    return [f"{key}={_fmt(value)}" for key, value in settings]


def _fmt(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_fmt(v) for v in value) + "]"
    return str(value)


def candidate_fixes(cfg: DictConfig, run: RunSpec | None = None) -> list[tuple[str, dict[str, Any]]]:
    """Concrete changes that lower the peak of ``cfg`` (its run spec ``run``, when already built), cheapest in
    model quality first."""
    run = run or run_spec(cfg, PREDICTED_DEVICE)
    spec = run.unet
    out: list[tuple[str, dict[str, Any]]] = []
    ckpt = spec.gradient_checkpointing != "layer"
    flash = any(spec.attention_levels) and not spec.use_flash_attention
    if ckpt:
        out.append(("gradient checkpointing per resnet/attention block", {"model.gradient_checkpointing": "layer"}))
    if flash:
        out.append(("memory-efficient attention (SDPA/flash)", {"model.use_flash_attention": True}))
    if ckpt and flash:
        out.append(("checkpointing + memory-efficient attention",
                    {"model.gradient_checkpointing": "layer", "model.use_flash_attention": True}))
    if any(spec.attention_levels):
        levels = list(spec.attention_levels)
        finest = levels.index(True)
        levels[finest] = False
        out.append((f"no attention at level {finest}", {"model.attention_levels": levels}))
    step = math.lcm(spec.norm_num_groups, *[h for h, a in zip(spec.num_head_channels, spec.attention_levels) if a])
    smaller = [max(step, c // 2 // step * step) for c in spec.channels]
    if smaller != list(spec.channels):
        out.append(("half the channels", {"model.channels": smaller}))
    unit = run.encoding.factor * spec.downsampling
    vol = list(run.shapes.volume)
    reduced = [max(unit, (v * 3 // 4) // unit * unit) for v in vol]
    if reduced != vol:
        out.append(("a smaller volume (3/4 per axis)", {"data.volume_shape": reduced}))
    return out


def run_preflight(cfg: DictConfig, name: str = "", suggest: bool = True,
                  margin: float = DEFAULT_SAFETY_MARGIN, compile: bool = True, phases: bool = True,
                  timing: bool = True, run: RunSpec | None = None) -> PreflightResult:
    """Static checks, then the predicted per-GPU peak, the verdict against the budget, and fixes if it does not fit.

    The step predicted is the one the GPU run runs: compiled or eager as ``model.compile`` says
    (:func:`predict_memory`); ``compile=False`` traces a compiled run eagerly (an upper bound, in seconds: the
    table over every experiment). The fixes are always predicted eagerly (an upper bound of their compiled step).
    ``phases=False`` leaves out validation and sampling, ``timing=False`` the step's FLOPs and time (a CPU run's
    verdict in ``train.py``: its peak is the training step's, and a GPU's time means nothing there).

    ``run``: the config's run spec when it is already resolved (:func:`voxdiff.run.spec.run_spec`); by default it
    is resolved here for :data:`PREDICTED_DEVICE`, every configuration problem in one pass. Everything predicted
    is read from it; the fixes are resolved for its device."""
    problems: list[ConfigError] = []
    if run is None:
        run, problems = run_spec_problems(cfg, PREDICTED_DEVICE)
    result = PreflightResult(name=name or str(select(cfg, "task_name", "")), problems=problems)
    if result.problems:
        return result
    result.gpu = run.gpu
    result.budget_gib, result.budget_source = gpu_budget_gib(run)
    if run.preflight.safety_margin is not None:
        margin = run.preflight.safety_margin
    result.margin = margin
    if run.kind == "stage1":
        return _stage1_preflight(cfg, run, result, margin)
    batch = run.batch
    result.shapes = run.shapes
    result.levels = run.unet.levels
    with torch.device("meta"):
        model = traced_unet(run, ncdhw=True)  # parameters, checkpoint bytes, the time model's (NCDHW) count
    result.params = sum(p.numel() for p in model.parameters())
    parallel = run.parallel
    result.parallel, result.strategy, result.world_size = parallel, parallel.strategy, parallel.world_size
    latents = batch.get("image_z")
    result.data = data_memory(run.resources.data, tuple(latents[1:]) if latents else None)
    report = predict_memory(run, compile=None if compile else False)
    result.report = report
    peak = report.peak_needed  # one rank's: the trace is of what one GPU of the strategy holds (with CUDA graphs,
    # their pool's reserved segments where larger)
    if phases and parallel.strategy != "fsdp":  # validation and sampling: the whole model, as on one GPU or DDP
        result.phases = predict_phases(run, training=report)
        # validation and sampling run eagerly; with CUDA graphs the graphs' pool keeps its segments meanwhile
        eager = {"validation": result.phases.validation, "sampling": result.phases.sampling}
        phase = max(eager, key=eager.__getitem__)
        if eager[phase] + report.graph_pool_needed > peak:
            peak, result.peak_phase = eager[phase] + report.graph_pool_needed, phase
    one = {k: (1, *v[1:]) for k, v in batch.items()}
    recipe = traced_recipe(run)
    cost = run_step_cost(run, model) if timing else None
    result.needs = run_needs(
        run, model, ema=recipe.ema is not None, data=result.data,
        sample_bytes=sum(4 * math.prod(v) for v in one.values()), processes_per_node=parallel.processes_per_node,
        world_size=parallel.world_size, cost=cost,
        gpu=run.gpu.name,
        kind=step_kind(report.model_step == "compiled" or (run.unet.compile and report.model_step != "eager"),
                       run.unet.cuda_graphs),
        env=os.environ, latent_shape=tuple(latents[1:]) if latents else None)
    result.per_gpu_peak_gib = peak / GiB
    result.need_gib = _need(peak, report, margin)
    result.fits = result.need_gib <= result.budget_gib
    if suggest and not result.fits:
        # each fix is traced eagerly: seconds instead of a compiled trace each; eager is the compiled step's upper
        # bound, so a fix said to fit does
        result.suggestions_step = "eager"
        for change, overrides in candidate_fixes(cfg, run):
            fixed_run, fixed_problems = run_spec_problems(with_overrides(cfg, overrides), run.device_type)
            if fixed_problems:
                continue
            r = predict_memory(fixed_run, compile=False)
            p = r.peak_needed
            need = _need(p, r, margin)
            result.suggestions.append(Suggestion(
                change, override_args(overrides.items()), p / GiB, need, need <= result.budget_gib))
        result.suggestions.sort(key=lambda s: (not s.fits, s.need_gib))
    return result


def _stage1_preflight(cfg: DictConfig, run: RunSpec, result: PreflightResult, margin: float) -> PreflightResult:
    """A VQ-VAE stage 1: its training step and its latent-cache pass traced (:mod:`voxdiff.preflight.stage1`), the
    larger against the GPU's budget; its checkpoints against the run directory's disk."""
    try:
        stage1 = predict_stage1(cfg, run)
    except ConfigError as err:
        result.problems.append(err)
        return result
    result.stage1, result.params = stage1, stage1.params
    peak = max(stage1.peak_allocated, stage1.cache_pass)
    result.peak_phase = "stage-1 step" if stage1.peak_allocated >= stage1.cache_pass else "latent-cache pass"
    result.per_gpu_peak_gib = peak / GiB
    result.need_gib = (peak * (1.0 + margin) + stage1.cuda_context_bytes) / GiB
    result.fits = result.need_gib <= result.budget_gib
    result.parallel = run.parallel
    with torch.device("meta"):
        model = build_vqvae(run.vqvae)
    result.needs = run_needs(run, model, ema=False, data=None, sample_bytes=0, processes_per_node=1, world_size=1,
                             cost=None, gpu=run.gpu.name, kind="eager", env=os.environ)
    return result


def static_problems(cfg: DictConfig) -> list[ConfigError]:
    """Every problem of ``cfg`` as the preflight sees it: those of its run spec for the GPU it predicts
    (:func:`voxdiff.run.spec.run_spec_problems`); empty when it is valid. Never raises for a config problem."""
    return run_spec_problems(cfg, PREDICTED_DEVICE)[1]


def run_step_cost(run: RunSpec, model: torch.nn.Module) -> StepCost:
    """What the time model counts for one training step of ``run`` (:func:`~voxdiff.preflight.resources.step_cost`):
    the FLOPs and operator calls of its UNet ``model`` (built on meta: :func:`traced_unet`) at its batch, and its
    passes over the weights (the EMA at its interval, the gradients' passes of its clipping and guard)."""
    recipe = traced_recipe(run)
    return step_cost(model, run.batch, run.mode, run.encoding,
                     ema_every_n_steps=recipe.ema.every_n_steps if recipe.ema is not None else None,
                     grad_bytes_per_param=gradient_pass_bytes(recipe, run.device_type, run.precision.scales_loss))


def training_verdict(cfg: DictConfig, run: RunSpec | None = None, suggest: bool = True) -> PreflightResult | None:
    """The preflight's verdict for this run on this machine; None when the step is not modelled (a VQ-VAE
    stage 1).

    ``train.py`` calls it before anything is built: the same traced step as ``preflight.py``
    (:func:`run_preflight`), against the local GPU's memory for a GPU run and against the host's memory
    (:func:`~voxdiff.preflight.resources.host_memory_bytes`) for a CPU run — the traced peak of a CPU step (fp32,
    the precision a CPU run uses, and the attention it computes: ``model.use_flash_attention=auto`` is off there) is
    the bytes its tensors hold; the CUDA context and the allocator's rounding that the prediction adds make it a
    slight over-estimate there. The step traced is the one of the run spec resolved for the device the run starts
    on (``train.py``'s), not a GPU's. A model far too large for the machine (29 billion parameters on a 24 GiB host)
    is refused in about a second with the preflight's fixes, instead of failing in the allocator after a minute of
    building. A budget of the user's own, ``+preflight.gpu_memory_gib=N`` (and ``+preflight.safety_margin=M``),
    replaces the machine's: the prediction's error is up to 34% on the measured rows, so a config at the edge can
    be started on purpose.

    Args:
        cfg: the run's composed config.
        run: its run spec resolved for the device it starts on (``train.py``'s, :func:`voxdiff.run.spec.run_spec`
            with no device: the precision decided there, ``model.compile``/``use_flash_attention=auto`` resolved
            there); else it is resolved here.
        suggest: predict fixes when it does not fit (the batch-size choice does without).

    Raises:
        ConfigError: an unknown ``preflight.gpu`` (:func:`~voxdiff.run.gpus.resolve_gpu`), or any other
            problem of the run spec.
    """
    if run is None:
        run = run_spec(cfg)
    if run.kind != "diffusion":
        return None
    on_host = run.device_type == "cpu" and run.preflight.gpu_memory_gib is None
    processes = run.parallel.processes_per_node
    if on_host:  # a CPU run, and no budget of the user's own (+preflight.gpu_memory_gib=N)
        run = replace(run, preflight=replace(run.preflight, gpu_memory_gib=host_memory_bytes() / processes / GiB))
    result = run_preflight(cfg, name=str(cfg.get("task_name", "")), suggest=suggest, phases=not on_host,
                           timing=not on_host, run=run)
    if on_host:
        result.budget_source = "host memory" + (f" shared by {processes} processes" if processes > 1 else "")
    return result
