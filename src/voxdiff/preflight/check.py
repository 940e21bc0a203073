"""Preflight of one configuration: static rules, then the memory of the training step that ``train.py`` runs.

The traced step is the trainer's own object, :class:`voxdiff.step.TrainStep`, made as :func:`step_plan` says:
the UNet from :func:`voxdiff.config.build_model` (with its checkpointing policy), the recipe of
``preflight.recipe`` (``system``: :func:`voxdiff.step.recipe_from_config` — the configured diffusion loss, AdamW
as ``system.optim`` sets it, ``trainer.gradient_clip_val`` and the non-finite guard, the EMA as ``system.ema``
says, gradients freed after the optimizer step), the batch the data module hands over (``data.batch_size``
volumes, or latents for a learned encoding), and the precision :func:`voxdiff.step.decide_precision` picks for the
GPU. The measure mode (:mod:`voxdiff.preflight.measure`) runs the same plan on a GPU. Nothing here needs a GPU;
:func:`run_preflight` takes ~1 s per configuration on a laptop CPU (more when it suggests fixes).

Under ``trainer=ddp`` / ``trainer=fsdp`` (more than one process) the step is traced as one rank runs it — DDP's
buckets, FSDP's shards, the all-gathered unit in flight, the sharded AdamW state and EMA
(:mod:`voxdiff.preflight.distributed`) — and the per-GPU peak is that rank's. The host memory of the data
module per rank (and node) is reported beside it.

A run that compiles its model (``model.compile``: ``auto`` is on for the GPU predicted) is predicted compiled
(:mod:`voxdiff.preflight.compiled`: 10-25 s the first time for a full-size UNet, then read from its cache), a DDP
rank too; an FSDP rank, a gradient-checkpointed model, the fixes and ``run_preflight(compile=False)`` are traced
eagerly, an upper bound that the report names (``model_step``).
"""

from __future__ import annotations

import copy
import math
import os
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from voxdiff.config import Shapes, select
from voxdiff.encodings.base import Encoding
from voxdiff.errors import ConfigError
from voxdiff.models.unet import UNetSpec, build_unet_from_spec
from voxdiff.preflight.distributed import DataMemory, data_memory
from voxdiff.run.gpus import DEFAULT_GPU, GPUS, GpuSpec
from voxdiff.preflight.memory import DEFAULT_SAFETY_MARGIN, MemoryReport, predict_step_memory
from voxdiff.preflight.phases import PhasesReport, predict_phases
from voxdiff.preflight.resources import RunNeeds, run_needs, step_cost
from voxdiff.preflight.stage1 import Stage1Report, predict_stage1
from voxdiff.run.parallel import Parallel
from voxdiff.run.spec import RunSpec, run_spec, run_spec_problems
from voxdiff.step import SEED, Recipe, batch_shapes
from voxdiff.units import GiB

PREDICTED_DEVICE = "cuda"
"""The device the preflight predicts a run on: a GPU. It resolves the model's ``auto`` switches for it (SDPA
attention on: :meth:`voxdiff.models.UNetSpec.for_device`) and picks the optimizer torch runs there (fused AdamW)."""


def gpu_budget_gib(run: RunSpec) -> tuple[float, str]:
    """The memory budget per GPU of ``run`` and where it comes from: ``preflight.gpu_memory_gib``, else the memory
    of its GPU type (:func:`~voxdiff.run.gpus.resolve_gpu`)."""
    if run.preflight.gpu_memory_gib is not None:
        return run.preflight.gpu_memory_gib, "preflight.gpu_memory_gib"
    source = "default GPU" if run.gpu_source == "default" else run.gpu_source
    return run.gpu.total_gib, f"{source} {run.gpu.name}"


@dataclass(frozen=True)
class StepPlan:
    """What the training step of a config is made of, for the trace (:func:`predict_memory`) and the measure mode.

    Attributes:
        encoding: the encoding (volumes → UNet input).
        shapes: the encoded shapes.
        spec: the UNet's validated arguments, resolved for :data:`PREDICTED_DEVICE`.
        recipe: the step's recipe (``preflight.recipe``, default ``system``).
        batch: shapes of the tensors of one batch as the data module hands them over.
        mode: ``bravo`` or ``seg``.
        run: the run's :class:`~voxdiff.run.spec.RunSpec` (resolved for :data:`PREDICTED_DEVICE`, or for the
            device a run starts on: :func:`voxdiff.preflight.host.training_verdict`), which the above are taken
            from; the precision traced is its ``precision``, the GPU its ``gpu``.
    """

    encoding: Encoding
    shapes: Shapes
    spec: UNetSpec
    recipe: Recipe
    batch: dict[str, tuple[int, ...]]
    mode: str
    run: RunSpec

    def build_model(self):
        """The UNet of the plan (call under ``torch.device("meta")`` to build it at no cost)."""
        return build_unet_from_spec(self.spec, preserve_rng_state=False)

    @property
    def input_shape(self) -> tuple[int, ...]:
        """``(B, C_in, d, h, w)`` of the UNet input."""
        return (next(iter(self.batch.values()))[0], *self.shapes.unet_input)


def step_plan(run: RunSpec | DictConfig) -> StepPlan:
    """The :class:`StepPlan` of a diffusion run: its spec (a config is resolved for :data:`PREDICTED_DEVICE`) with
    the step of ``preflight.recipe``.

    Raises:
        ConfigError: every problem of the run spec (:func:`voxdiff.run.spec.run_spec`).
    """
    if not isinstance(run, RunSpec):
        run = run_spec(run, PREDICTED_DEVICE)
    recipe = SEED if run.preflight.recipe == "seed" else run.recipe
    return StepPlan(run.encoding, run.shapes, run.unet, recipe,
                    batch_shapes(run.encoding, run.shapes.volume, run.batch_size), run.mode, run)


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
    strategy: str = "single"  # single | ddp | fsdp (voxdiff.run.parallel.parallel_of)
    world_size: int = 1
    per_gpu_peak_gib: float = 0.0  # predicted max_memory_allocated of one GPU (one rank of DDP/FSDP)
    need_gib: float = 0.0  # per_gpu_peak * (1 + margin) + CUDA context
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

    @property
    def misfits(self) -> tuple[ConfigError, ...]:
        """What besides GPU memory does not fit (disk, host memory), each naming the key, the value and a fix."""
        return self.needs.misfits if self.needs is not None else ()

    @property
    def ok(self) -> bool:
        return not self.problems and (self.fits or not self.modelled) and not self.misfits


def predict_memory(cfg: DictConfig | None = None, compile: bool | None = None,
                   plan: StepPlan | None = None) -> MemoryReport:
    """Trace two training steps of ``cfg`` on the meta device, as one GPU of its strategy runs them (one rank of a
    DDP or FSDP run: :mod:`voxdiff.preflight.distributed`), for the GPU type of its run spec
    (:func:`~voxdiff.run.gpus.resolve_gpu`); see the module docstring for what is traced.

    Args:
        cfg: the run config (not needed when ``plan`` is given).
        compile: whether to trace a compiled run's step compiled (default) or eagerly (False: seconds instead of
            a compiled trace; the report's ``model_step`` is then ``upper bound (eager)``). Whether the run compiles
            is ``model.compile`` as a GPU run resolves it (``auto`` and ``true`` compile:
            :meth:`voxdiff.models.UNetSpec.for_device`), in ``model.compile_mode``; a backend other than inductor
            (``aot_eager``) is predicted as the eager step.
        plan: the step's plan when already made (:func:`step_plan`), else it is made here.

    Raises:
        ConfigError: every problem of the run spec (:func:`step_plan`).
    """
    plan = plan or step_plan(cfg)
    spec = plan.spec
    compiles = spec.compile and spec.compile_backend == "inductor"
    report = predict_step_memory(
        plan.build_model, plan.input_shape, plan.recipe,
        batch=plan.batch, encoding=plan.encoding, mode=plan.mode, precision=plan.run.precision.name,
        attention="flash" if plan.spec.use_flash_attention else "materialised", gpu=plan.run.gpu,
        parallel=plan.run.parallel, compile=compiles and compile is not False, compile_mode=spec.compile_mode,
    )
    if compiles and compile is False:
        return replace(report, model_step="upper bound (eager)", notes=(*report.notes, (
            "the run compiles its model (model.compile); its step was traced eagerly here, an upper bound")))
    return report


def _need(peak_bytes: float, report: MemoryReport, margin: float) -> float:
    return (peak_bytes * (1.0 + margin) + report.cuda_context_bytes) / GiB


def _with(cfg: DictConfig, overrides: dict[str, Any]) -> DictConfig:
    new = copy.deepcopy(cfg)
    for key, value in overrides.items():
        OmegaConf.update(new, key, value, merge=False, force_add=True)
    return new


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
    if run.kind == "stage1":
        return _stage1_preflight(cfg, run, result, margin)
    plan = step_plan(run)
    result.shapes = plan.shapes
    result.levels = plan.spec.levels
    with torch.device("meta"):
        model = plan.build_model()  # for the parameter count and the checkpoint's bytes
    result.params = sum(p.numel() for p in model.parameters())
    parallel = run.parallel
    result.parallel, result.strategy, result.world_size = parallel, parallel.strategy, parallel.world_size
    latents = plan.batch.get("image_z")
    result.data = data_memory(run.resources.data, tuple(latents[1:]) if latents else None)
    report = predict_memory(compile=None if compile else False, plan=plan)
    result.report = report
    peak = report.peak_allocated  # one rank's: the trace is of what one GPU of the strategy holds
    if phases and parallel.strategy != "fsdp":  # validation and sampling: the whole model, as on one GPU or DDP
        result.phases = predict_phases(plan, training=report)
        peak, result.peak_phase = max(peak, result.phases.peak_allocated), result.phases.peak_phase
    one = {k: (1, *v[1:]) for k, v in plan.batch.items()}
    result.needs = run_needs(
        run, model, ema=plan.recipe.ema is not None, data=result.data,
        sample_bytes=sum(4 * math.prod(v) for v in one.values()), processes_per_node=parallel.processes_per_node,
        world_size=parallel.world_size, cost=step_cost(model, plan.batch, plan.mode, plan.encoding) if timing else None,
        gpu=run.gpu.name,
        compiled=report.model_step == "compiled" or (plan.spec.compile and report.model_step != "eager"),
        env=os.environ, latent_shape=tuple(latents[1:]) if latents else None)
    result.per_gpu_peak_gib = peak / GiB
    result.need_gib = _need(peak, report, margin)
    result.fits = result.need_gib <= result.budget_gib
    if suggest and not result.fits:
        # each fix is traced eagerly: seconds instead of a compiled trace each; eager is the compiled step's upper
        # bound, so a fix said to fit does
        result.suggestions_step = "eager"
        for change, overrides in candidate_fixes(cfg, run):
            fixed_run, fixed_problems = run_spec_problems(_with(cfg, overrides), run.device_type)
            if fixed_problems:
                continue
            r = predict_memory(compile=False, plan=step_plan(fixed_run))
            p = r.peak_allocated
            need = _need(p, r, margin)
            result.suggestions.append(Suggestion(
                change, [f"{k}={_fmt(v)}" for k, v in overrides.items()], p / GiB, need, need <= result.budget_gib))
        result.suggestions.sort(key=lambda s: (not s.fits, s.need_gib))
    return result


def _stage1_preflight(cfg: DictConfig, run: RunSpec, result: PreflightResult, margin: float) -> PreflightResult:
    """A VQ-VAE stage 1: its training step and its latent-cache pass traced (:mod:`voxdiff.preflight.stage1`), the
    larger against the GPU's budget; its checkpoints against the run directory's disk."""
    from voxdiff.encodings.vqvae import build_vqvae

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
                             cost=None, gpu=run.gpu.name, compiled=False, env=os.environ)
    return result


def static_problems(cfg: DictConfig) -> list[ConfigError]:
    """Every problem of ``cfg`` as the preflight sees it: those of its run spec for the GPU it predicts
    (:func:`voxdiff.run.spec.run_spec_problems`); empty when it is valid. Never raises for a config problem."""
    return run_spec_problems(cfg, PREDICTED_DEVICE)[1]
