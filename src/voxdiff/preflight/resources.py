"""What a run needs beside GPU memory: disk for its checkpoints and latent cache, host memory for its data, and time.

Pure functions of plain values (sizes, counts, the model built on the meta device) and of the run spec
(:func:`run_needs`); :mod:`voxdiff.preflight.check` gathers them into its verdict. The one home of what a run asks of
its disk, its nodes' memory and its time. Sizes are bytes.

* **Disk.** :func:`checkpoint_nbytes` is the size of one checkpoint file from the state that will be saved: the
  module's ``state_dict`` (float32 weights and buffers), the EMA's float32 shadow of every floating parameter, and
  AdamW's two moments and step counter per parameter; each tensor a 64-byte-aligned zip record with
  :data:`PER_TENSOR_BYTES` of zip headers and pickled keys, plus :data:`FIXED_BYTES` of loops, callbacks, RNG states
  and the config. Against a real checkpoint of a CPU run it is within 1% (``tests/preflight/test_resources.py``).
  An atomic write keeps the old file until the new one is complete, so writing needs two checkpoints of room.
* **Host memory.** The data a rank caches (:class:`DataMemory`, :func:`data_memory`) times the ranks of
  one node, plus the batches DataLoader workers hold in flight, against the node's memory, Slurm's allocation, or
  ``preflight.host_memory_gib``; this machine's is :func:`host_memory_bytes` (the cgroup's limit where lower).
* **Time.** :func:`step_cost` counts the FLOPs (``torch.utils.flop_counter``) and the operator calls of one
  forward+backward on the meta device, and the bytes of the step's passes over its weights beyond the optimizer's
  (the EMA; the gradients' norm and clipping: :func:`gradient_pass_bytes`); :data:`STEP_THROUGHPUT` turns them into
  seconds on a GPU whose efficiency was measured, as ``tflop / tflops + ops * op_us + weight bytes / bandwidth``
  (and, for the CUDA-graph step, the bytes the step's operators touch: :class:`StepCost`, :class:`Throughput`);
  ``bench/fit_step_time.py`` fits the constants from measured step times and prints the error.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from voxdiff.config import config_dir
from voxdiff.data.nifti import readable_subjects
from voxdiff.data.split import split_subjects
from voxdiff.errors import ConfigError
from voxdiff.preflight.tracker import MetaMemoMode, tensors_in
from voxdiff.run.spec import Parallel
from voxdiff.slurm import parse_slurm_memory, parse_slurm_time, read_site_env, slurm_job_memory
from voxdiff.step import SEED, Recipe, TrainStep, decide_precision
from voxdiff.step.optim import optimizer_impl
from voxdiff.units import GiB, memory_size, size

PER_TENSOR_BYTES = 280
"""Zip local and central headers of one tensor record, and its key in the pickled structure (calibrated on a
voxdiff checkpoint: 1443 tensors, 4.98 MB file, 4.56 MB of aligned data, 21 kB of the rest)."""
FIXED_BYTES = 24 * 1024
"""Everything in a checkpoint that is not a tensor record: loops, callbacks, the config, the RNG states."""


def _aligned(nbytes: int) -> int:
    return -(-nbytes // 64) * 64


def checkpoint_nbytes(state: Iterable[torch.Tensor], params: Iterable[torch.Tensor], *, ema: bool,
                      adam_moments: int = 2) -> int:
    """The bytes of one training checkpoint (meta tensors are fine: only shapes and dtypes are read).

    Args:
        state: the tensors of the system's ``state_dict`` (weights and buffers, as stored).
        params: the trainable parameters (AdamW's state and the EMA's shadow are per parameter, float32).
        ema: whether the EMA's shadow is saved.
        adam_moments: AdamW's ``exp_avg`` and ``exp_avg_sq``; each parameter also has a 0-d ``step`` tensor.
    """
    tensors = [_aligned(t.numel() * t.element_size()) for t in state]
    for p in params:
        moment = _aligned(p.numel() * p.element_size())
        tensors += [moment] * adam_moments + [_aligned(4)]
        if ema and p.is_floating_point():
            tensors.append(_aligned(p.numel() * 4))
    return sum(tensors) + PER_TENSOR_BYTES * len(tensors) + FIXED_BYTES


LATENT_FILE_OVERHEAD = 2240
"""Zip headers and the pickled record of one subject's latent file (``torch.save`` of its four tensors: 2205-2269
bytes measured for latents of 4×4³ and 4×40×64×64)."""
LATENT_INDEX_BYTES = (1500, 150)
"""``index.json``: what made the cache and its statistics, then a line per subject (1770 bytes for 3 subjects)."""


def latent_cache_nbytes(subjects: int, latent_shape: tuple[int, ...], volume_shape: tuple[int, ...]) -> int:
    """Bytes of a latent cache (:func:`voxdiff.data.latents.write_latent_cache`) of ``subjects`` subjects: per
    subject one file holding the image and mask latents (float32, ``latent_shape`` each), the bit-packed
    full-resolution mask and the affine (float64 4×4); and the index."""
    per = (2 * _aligned(4 * math.prod(latent_shape)) + _aligned(-(-math.prod(volume_shape) // 8)) + _aligned(128)
           + LATENT_FILE_OVERHEAD + LATENT_INDEX_BYTES[1])
    return subjects * per + LATENT_INDEX_BYTES[0]


def free_bytes(path: str | Path) -> tuple[int, Path]:
    """Free bytes on the file system that will hold ``path`` (its nearest existing ancestor), and that ancestor."""
    where = Path(path).absolute()
    while not where.exists() and where != where.parent:
        where = where.parent
    return shutil.disk_usage(where).free, where


@dataclass(frozen=True)
class DiskNeed:
    """The disk a run's checkpoints take.

    Attributes:
        checkpoint: bytes of one checkpoint file.
        kept: how many checkpoint files the run keeps at once (``save_top_k`` best ones, ``last.ckpt`` and a guide
            snapshot); None when ``save_top_k=-1`` keeps every one.
        free: free bytes where the run directory will be.
        where: the existing folder that was measured.
        latent_cache: bytes of the latent cache a latent run reads (of ``latent_subjects`` subjects, or of one
            when the subjects cannot be counted here); None for a run without one.
        latent_subjects: the subjects of ``latent_cache``, or None (then it is one subject's bytes).
    """

    checkpoint: int
    kept: int | None
    free: int
    where: Path
    latent_cache: int | None = None
    latent_subjects: int | None = None

    @property
    def write_fits(self) -> bool:
        """One atomic write fits: the previous checkpoint and the new one side by side."""
        return self.free >= 2 * self.checkpoint

    @property
    def kept_fits(self) -> bool:
        """Every kept checkpoint fits, with room for the one being written."""
        return self.kept is not None and self.free >= (self.kept + 1) * self.checkpoint

    def describe(self) -> str:
        kept = ("save_top_k=-1 keeps every checkpoint" if self.kept is None
                else f"{self.kept} kept ({size(self.kept * self.checkpoint)}) + 1 being written")
        verdict = ("fits" if self.kept_fits else "WARNING: the kept checkpoints will not all fit" if self.write_fits
                   else "DOES NOT FIT: not even one atomic checkpoint write")
        cache = "" if not self.latent_cache else (
            f"; latent cache {size(self.latent_cache)} ({self.latent_subjects} subjects)" if self.latent_subjects
            else f"; latent cache {size(self.latent_cache)} per subject")
        return (f"checkpoint {size(self.checkpoint)} each, {kept}; {size(self.free)} free under {self.where}{cache}: "
                f"{verdict}")


def kept_checkpoints(save_top_k: int | None, last: bool, guide: bool = False) -> int | None:
    """Checkpoint files kept at once: the ``save_top_k`` best (None for -1, every one), ``last.ckpt`` and the guide
    snapshot of autoguidance (``guide-step<N>.ckpt``)."""
    if save_top_k is not None and save_top_k < 0:
        return None
    return max(0, save_top_k or 0) + int(last) + int(guide)


# ------------------------------------------------------------------------------------------------------ host memory
@dataclass(frozen=True)
class HostNeed:
    """Host memory of one node: the data the ranks cache and what their DataLoader workers hold in flight.

    Attributes:
        cached: bytes the ranks of one node cache (every rank caches every subject).
        in_flight: bytes of the batches the workers of one node prepare ahead (``num_workers × prefetch_factor``
            batches per rank; the cache itself is shared with forked workers, copy-on-write).
        budget: bytes the node has for the job.
        source: where the budget comes from.
    """

    cached: int
    in_flight: int
    budget: int
    source: str

    @property
    def total(self) -> int:
        return self.cached + self.in_flight

    @property
    def fits(self) -> bool:
        return self.total <= self.budget

    def describe(self) -> str:
        return (f"host memory per node: data cache {size(self.cached)} + workers' batches {size(self.in_flight)} = "
                f"{size(self.total)} of {size(self.budget)} ({self.source}): "
                + ("fits" if self.fits else "DOES NOT FIT"))


_CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def host_memory_bytes() -> int:
    """Physical memory of this machine, or the cgroup's limit (a container, a Slurm allocation) if lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in _CGROUP_LIMITS:
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return int(total)


@dataclass(frozen=True)
class DataMemory:
    """Host memory that a rank's data module holds (``data.cache=memory``, a latent cache ``in_memory``): every
    rank loads the whole data set, train and validation subjects alike.

    Attributes:
        per_subject_bytes: bytes one cached subject takes.
        subjects: how many are cached, or None when the data folder cannot be read here.
        what: what one subject holds.
    """

    per_subject_bytes: int
    subjects: int | None
    what: str

    @property
    def per_rank_bytes(self) -> int | None:
        """Bytes one rank holds, or None when the subjects cannot be counted here."""
        return None if self.subjects is None else self.per_subject_bytes * self.subjects

    def describe(self, parallel: Parallel) -> str:
        """One line: per rank and per node (the ranks on one node), or per subject when they cannot be counted."""
        each = f"{memory_size(self.per_subject_bytes)} per subject ({self.what})"
        if self.per_rank_bytes is None:
            return f"{each}; every rank caches every subject (the data folder is not readable here to count them)"
        node = self.per_rank_bytes * parallel.processes_per_node
        return (f"{memory_size(self.per_rank_bytes)} of host memory per rank: {self.subjects} subjects × {each}"
                + (f"; {memory_size(node)} per node ({parallel.processes_per_node} ranks, each caches every subject)"
                   if parallel.processes_per_node > 1 else ""))


def data_memory(data: Mapping[str, Any], latent_shape: tuple[int, ...] | None = None) -> DataMemory | None:
    """What a rank's data module keeps in host memory, from the plain ``data:`` config; None when it keeps
    nothing (``data.cache=none|disk``, a latent cache with ``in_memory: false``).

    Args:
        data: the ``data:`` config.
        latent_shape: ``(C, d, h, w)`` of one modality's latents (a latent cache).
    """
    target = str(data.get("_target_", ""))
    voxels = math.prod(int(v) for v in data.get("volume_shape") or (0,))
    if target.endswith("LatentDataModule"):
        if not data.get("in_memory", True) or latent_shape is None:
            return None
        per = 2 * 4 * math.prod(latent_shape) + (voxels + 7) // 8 * bool(data.get("masks", True)) + 16 * 8
        return DataMemory(per, _latent_subjects(data.get("latent_dir")),
                          "image and mask latents, float32; the bit-packed mask; the affine")
    if data.get("cache", "none") != "memory":
        return None
    per = 2 * 4 * voxels  # image and mask, (1, D, H, W) float32 each (the MONAI pipeline's output)
    return DataMemory(per, _volume_subjects(data), "image and mask, float32")


def data_subjects(data: Mapping[str, Any]) -> int | None:
    """How many subjects the plain ``data:`` config has (training and validation), or None when its folder cannot
    be read here."""
    if str(data.get("_target_", "")).endswith("LatentDataModule"):
        return _latent_subjects(data.get("latent_dir"))
    return _volume_subjects(data)


def split_sizes(data: Mapping[str, Any]) -> tuple[int, int] | None:
    """``(training, validation)`` subjects of the plain ``data:`` config's split (``data.val_fraction``,
    ``data.split_seed``: :func:`voxdiff.data.split.split_subjects`), or None where fewer than two subjects are
    counted here (:func:`data_subjects`)."""
    subjects = data_subjects(data)
    if not subjects or subjects < 2:
        return None
    train, val = split_subjects([str(i) for i in range(subjects)], float(data.get("val_fraction") or 0.25),
                                int(data.get("split_seed") or 0))
    return len(train), len(val)


def validation_batch(data: Mapping[str, Any], batch_size: int, world_size: int = 1) -> int:
    """The largest batch one rank's validation loader gives: ``batch_size``, or the validation subjects each rank
    gets where the split has fewer (its loader keeps the last, smaller batch; Lightning's sampler gives each of
    ``world_size`` ranks ``ceil(subjects / world_size)``). ``batch_size`` where the subjects cannot be counted
    here."""
    sizes = split_sizes(data)
    if sizes is None:
        return batch_size
    return max(1, min(batch_size, math.ceil(sizes[1] / max(1, world_size))))


def _volume_subjects(data: Mapping[str, Any]) -> int | None:
    root = data.get("root")
    if root is None:  # the phantom, or subjects made from a template
        return int(data.get("num_subjects") or 0) or None
    subjects = readable_subjects(root, data.get("image_name"), data.get("mask_name"))
    return None if subjects is None else len(subjects)  # None: not readable from here, per subject only


def _latent_subjects(latent_dir: Any) -> int | None:
    try:
        return len(json.loads((Path(str(latent_dir)) / "index.json").read_text())["subjects"])
    except (OSError, ValueError, KeyError, TypeError):  # no cache (yet) here
        return None


def worker_bytes(sample_bytes: int, batch_size: int, num_workers: int, prefetch_factor: int | None,
                 ranks_per_node: int) -> int:
    """Bytes of the batches DataLoader workers hold ahead on one node (none when loading in the main process)."""
    if num_workers <= 0:
        return 0
    return ranks_per_node * num_workers * (prefetch_factor or 2) * batch_size * sample_bytes


# ------------------------------------------------------------------------------------------------------------ time
EMA_BYTES_PER_PARAM = 12
"""The EMA's update (``torch._foreach_lerp_`` in fp32): the average and the weight read, the average written."""
EMA_COPY_BYTES_PER_PARAM = 8
"""The EMA's update during ``system.ema.start_step`` (``torch._foreach_copy_``): the weight read, the average written.
A step time is predicted after it (the EMA then averages); a benchmark of a few steps runs inside it unless it sets
``system.ema.start_step=0``."""
NORM_BYTES_PER_PARAM = 4
"""The gradients' total norm (clipping, or the guard alone): every fp32 gradient read."""
SCALE_BYTES_PER_PARAM = 8
"""Clipping in place (``clip_grads_with_norm_`` or by value): every fp32 gradient read and written. Not with a fused
AdamW clipping by norm: its kernel takes the factor (:func:`voxdiff.step.optim.clip_gradients`)."""


@dataclass(frozen=True)
class StepCost:
    """What one training step costs: the FLOPs and operator calls of one forward+backward, counted on the meta
    device, the bytes its operators touch, and the step's passes over its weights beyond the optimizer's.

    Attributes:
        tflop: FLOPs of the forward and backward, in 10^12.
        ops: operator calls that launch work.
        params: the model's parameters.
        ema_every_n_steps: the EMA's interval (``system.ema.every_n_steps``); None: no EMA.
        grad_bytes_per_param: bytes per parameter read and written on the gradients (:func:`gradient_pass_bytes`).
        conv_weight_bytes: the weight operand's bytes summed over every convolution call, forward and backward (as
            traced: float32). A convolution's cost beyond its FLOPs that does not grow with the batch: the
            FLOPs per output voxel are ``2 x`` the weight's elements, so a term in its bytes is the convolution
            computed as if it had a fixed number of voxels more (small volumes and the UNet's deep levels).
        tensor_bytes: the bytes of the operands and results of every operator that launches work, less
            ``conv_weight_bytes`` (as traced: float32): the step's traffic, which grows with the batch.
    """

    tflop: float
    ops: int
    params: int = 0
    ema_every_n_steps: int | None = None
    grad_bytes_per_param: int = 0
    conv_weight_bytes: int = 0
    tensor_bytes: int = 0

    @property
    def weight_bytes(self) -> float:
        """Bytes per optimizer step of the EMA (averaged over its interval) and the gradient passes."""
        ema = EMA_BYTES_PER_PARAM / self.ema_every_n_steps if self.ema_every_n_steps else 0.0
        return self.params * (ema + self.grad_bytes_per_param)


def gradient_pass_bytes(recipe: Recipe, device_type: str, scales_loss: bool) -> int:
    """Bytes per parameter :meth:`voxdiff.step.TrainStep.clip_and_check` reads and writes on the gradients: none
    without clipping or guard; the norm alone for the guard, or for clipping by norm folded into a fused AdamW
    (not under a loss scaler); the norm and a pass in place otherwise."""
    guard = recipe.guard is not None and not scales_loss
    if recipe.clip is None:
        return NORM_BYTES_PER_PARAM if guard else 0
    folded = (recipe.clip.algorithm == "norm" and not scales_loss
              and optimizer_impl(recipe.optim, device_type) == "fused")
    return NORM_BYTES_PER_PARAM + (0 if folded else SCALE_BYTES_PER_PARAM)


class _OpCount(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the operators that launch work (views and metadata changes are free), the bytes of their operands and
    results, and the weight operand's bytes of each convolution (:class:`StepCost`)."""

    FREE = ("aten::view", "aten::_unsafe_view", "aten::t", "aten::detach", "aten::expand", "aten::permute",
            "aten::transpose", "aten::unsqueeze", "aten::squeeze", "aten::reshape", "aten::as_strided",
            "aten::alias", "aten::slice", "aten::select", "aten::split", "aten::chunk", "aten::unbind")
    #: the position of the weight among a convolution's arguments
    CONV_WEIGHT = {"aten::convolution": 1, "aten::convolution_backward": 2}

    def __init__(self) -> None:
        super().__init__()
        self.ops = self.conv_weight_bytes = self.tensor_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func._schema.name
        if name not in self.FREE:
            self.ops += 1
            nbytes = sum(t.numel() * t.element_size() for t in tensors_in((args, kwargs or {}, out)))
            if name in self.CONV_WEIGHT:
                weight = args[self.CONV_WEIGHT[name]]
                self.conv_weight_bytes += weight.numel() * weight.element_size()
                nbytes -= weight.numel() * weight.element_size()
            self.tensor_bytes += nbytes
        return out


def step_cost(model: torch.nn.Module, batch: Mapping[str, tuple[int, ...]], mode: str,
              encoding: Any = None, ema_every_n_steps: int | None = None, grad_bytes_per_param: int = 0) -> StepCost:
    """FLOPs, operator calls and the bytes they touch of one training forward+backward of ``model`` (built on meta)
    for a batch of these shapes (:func:`voxdiff.step.batch_shapes`), encoded by ``encoding``, as
    :class:`voxdiff.step.TrainStep` computes the loss; with the parameter count, the EMA's interval (None: no EMA)
    and the gradient passes' bytes per parameter (:func:`gradient_pass_bytes`) for the weight passes (none by
    default: a plain loop's step)."""
    from dataclasses import replace

    from torch.utils.flop_counter import FlopCounterMode

    step = TrainStep(model, replace(SEED, zero_grad_at="after_step"), encoding=encoding, mode=mode,
                     precision=decide_precision("32-true", "cpu").context(), device_type="cpu")
    tensors = {k: torch.empty(v, device="meta") for k, v in batch.items()}
    counter, flops = _OpCount(), FlopCounterMode(display=False)
    with MetaMemoMode(), flops, counter:  # the memo at the bottom: both counters see every op
        loss, _ = step.loss(tensors)
        loss.backward()
    model.zero_grad(set_to_none=True)
    return StepCost(flops.get_total_flops() / 1e12, counter.ops, sum(p.numel() for p in model.parameters()),
                    ema_every_n_steps, grad_bytes_per_param, counter.conv_weight_bytes, counter.tensor_bytes)


@dataclass(frozen=True)
class Throughput:
    """How fast a GPU runs a UNet step: ``seconds = tflop / tflops + ops * op_us / 1e6 + weight_bytes / bandwidth``,
    plus ``conv_weight_bytes / conv_weight_rate + tensor_bytes / tensor_rate`` where those two are set.

    Attributes:
        tflops: effective TFLOP/s on the FLOPs of the step.
        op_us: microseconds per operator call (launch and host overhead, memory-bound kernels).
        source: the measurements the constants were fitted to.
        bandwidth: bytes per second (read + written) of the step's passes over its weights
            (:attr:`StepCost.weight_bytes`): the GPU's measured device-to-device copy rate.
        conv_weight_rate: bytes per second of :attr:`StepCost.conv_weight_bytes` (each convolution's cost that
            does not grow with the batch); None: not part of this kind's model (too few measured rows to fit it).
        tensor_rate: bytes per second of :attr:`StepCost.tensor_bytes` (the step's traffic); None: as above.
    """

    tflops: float
    op_us: float
    source: str
    bandwidth: float
    conv_weight_rate: float | None = None
    tensor_rate: float | None = None

    def parts(self, cost: StepCost) -> dict[str, float]:
        """The step's seconds term by term (a term this kind does not model is left out)."""
        out = {"FLOPs": cost.tflop / self.tflops, "operator calls": cost.ops * self.op_us / 1e6}
        if self.conv_weight_rate:
            out["convolutions' fixed cost"] = cost.conv_weight_bytes / self.conv_weight_rate
        if self.tensor_rate:
            out["traffic"] = cost.tensor_bytes / self.tensor_rate
        out["weight passes"] = cost.weight_bytes / self.bandwidth
        return out

    def seconds(self, cost: StepCost) -> float:
        return sum(self.parts(cost).values())


def describe_parts(parts: Mapping[str, float]) -> str:
    """Where a predicted step goes, the largest term first: ``traffic 334 ms (72%), FLOPs 116 ms (25%), ...``."""
    total = sum(parts.values())
    return ", ".join(f"{name} {seconds * 1e3:.3g} ms ({seconds / total:.0%})"
                     for name, seconds in sorted(parts.items(), key=lambda kv: -kv[1]) if seconds > 0)


_GPU_SPEED = "../shared/notes/gpu-speed.md: exp11, exp11_1, exp9 4x, exp9 8x shapes, median of 10 steps"
H100_BANDWIDTH = 3.0e12
"""Bytes per second (read + written) of a device-to-device copy on an H100 80GB HBM3, as measured on the GPU machines
this project is lent (``/work/.library/device/KINDS.md``): the rate of the EMA's and the gradients' passes."""
STEP_THROUGHPUT: dict[tuple[str, str], Throughput] = {
    # fitted by bench/fit_step_time.py (least squares on relative error) to plain loops, which have no EMA nor
    # clipping; the README states the errors
    ("H100", "eager"): Throughput(383.0, 76.8, f"H100, fused AdamW + flash SDPA, eager; {_GPU_SPEED}",
                                  H100_BANDWIDTH),
    ("H100", "compiled"): Throughput(448.0, 56.5, f"H100, fused AdamW + flash SDPA + torch.compile; {_GPU_SPEED}",
                                     H100_BANDWIDTH),
    # voxdiff's own step with CUDA graphs, fitted by bench/fit_step_time.py to its eleven measured rows
    # (reference/h100_bench_gpu_step_v3.csv to _v7.csv) less the weight passes each made at H100_BANDWIDTH (the rows
    # before session 16: the EMA copying the weights inside system.ema.start_step and clipping by norm in place, 20
    # bytes per parameter; since session 17: the EMA's 12 bytes per its interval and the clipping norm's 4), with four
    # terms since session 24: FLOPs, operator calls, the convolutions' weight bytes (a fixed cost per convolution: as
    # if each had about 6,000 output voxels more) and the step's tensor bytes (its traffic, which grows with the
    # batch); since session 25 the FLOP rate is held at or under the dense bf16 peak (989.4 TFLOP/s, where the
    # eleven rows put it). Errors: exp11 +5.2% and -9.3%, exp11 at batch 32 -7.6%, exp11_1 +7.7%, exp9_ldm_4x_bravo
    # +0.3% and -0.7% and at batch 2 +3.1%, exp9_ldm_8x_bravo +1.3%, -0.4%, -1.5% and -0.5%; leave-one-out up to
    # +12.5%, and -17.7% at batch 32. The README states them
    ("H100", "cudagraphs"): Throughput(989.4, 8.1, "H100, voxdiff's step compiled with CUDA graphs "
                                                   "(reduce-overhead); eleven rows, h100_bench_gpu_step_v3-v7.csv",
                                       H100_BANDWIDTH, conv_weight_rate=327.4e9, tensor_rate=2140.6e9),
    # the H100's constants, checked (not fitted) on the four rows of the same step measured on an H200
    # (reference/h200_bench_gpu_step.csv, _v2.csv): exp9_ldm_4x_bravo at batch 1 +4.5% and at batch 4 +5.8%, exp11 at
    # batch 32 +1.7% and at batch 1 +17.8% (predicted long: the H200's faster memory is not modelled, nor its copy
    # rate measured: H100_BANDWIDTH); and on four channels-last rows (h200_bench_gpu_step_v3.csv, _v4.csv; counted
    # as NCDHW steps): exp11 at batch 32 +0.9%, at batch 1 exp11 +21.4%, exp11_1 +18.1%, exp9_ldm_8x_bravo +27.4%
    ("H200", "cudagraphs"): Throughput(989.4, 8.1, "the H100's constants for voxdiff's step compiled with CUDA graphs, "
                                                   "checked on four H200 rows (h200_bench_gpu_step.csv, _v2.csv)",
                                       H100_BANDWIDTH, conv_weight_rate=327.4e9, tensor_rate=2140.6e9),
}
"""Per (GPU type, step kind: :func:`step_kind`) throughput. A GPU type without an entry gets no time prediction (never
a guess)."""


def step_kind(compiled: bool, cuda_graphs: bool) -> str:
    """The :data:`STEP_THROUGHPUT` kind of a step: ``eager``, ``compiled`` (torch's default mode) or ``cudagraphs``
    (a compile mode that captures CUDA graphs)."""
    return "cudagraphs" if compiled and cuda_graphs else "compiled" if compiled else "eager"


#: what a predicted step time is for a channels-last run (``model.channels_last``, ``auto`` on a compiled GPU run):
#: every row of :data:`STEP_THROUGHPUT` was measured in NCDHW (the whole channels-last steps measured,
#: exp11 at batch 1 in sessions 15 and 31, at batch 32 in session 31, exp9_ldm_8x_bravo in session 26, are not among
#: them; README, "Channels-last"), and those ran 0.94-1.01x NCDHW's time
CHANNELS_LAST_TIME = ("NCDHW's: the time model was fitted to NCDHW steps only, and compiled channels-last steps "
                      "measured 0.94-1.01x their time")


@dataclass(frozen=True)
class RunTime:
    """How long ``max_steps`` take, and how many Slurm jobs that is.

    Attributes:
        step_s: predicted seconds per optimizer step.
        max_steps: ``trainer.max_steps``.
        gpus: GPUs of the run (all of them are busy for the whole run).
        time_limit_s: the Slurm job's time limit, if known.
        warn_s: seconds before the limit at which the job saves and requeues itself (``WARN_SECONDS``).
        throughput: what ``step_s`` was computed with.
        gpu_s: the step's seconds on the GPU, without the wait for data (None: the same as ``step_s``).
        parts: the GPU's seconds term by term (:meth:`Throughput.parts`; None: not given).
        layout: what the time is for the run's memory layout ("": the default layout, as measured;
            :data:`CHANNELS_LAST_TIME` for a channels-last run).
    """

    step_s: float
    max_steps: int
    gpus: int
    time_limit_s: float | None
    warn_s: float
    throughput: Throughput
    gpu_s: float | None = None
    parts: Mapping[str, float] | None = None
    layout: str = ""

    @property
    def wall_s(self) -> float:
        return self.step_s * self.max_steps

    @property
    def gpu_hours(self) -> float:
        return self.wall_s * self.gpus / 3600

    @property
    def jobs(self) -> int | None:
        """Slurm jobs the run takes (the first and its requeues), or None without a time limit."""
        if self.time_limit_s is None:
            return None
        usable = self.time_limit_s - self.warn_s
        return max(1, math.ceil(self.wall_s / usable)) if usable > 0 else None

    def describe(self) -> str:
        jobs = self.jobs
        limit = (f"; with a {self.time_limit_s / 3600:.1f} h Slurm limit: {jobs} job(s), {jobs - 1} requeue(s)"
                 if jobs is not None else "")
        waiting = (f" ({(self.step_s - self.gpu_s) * 1e3:.0f} of them waiting for data, as the data: line says)"
                   if self.gpu_s is not None and self.step_s > self.gpu_s else "")
        split = f"; the step: {describe_parts(self.parts)}" if self.parts else ""
        return (f"time: {self.step_s * 1e3:.0f} ms/step predicted{waiting}, {self.max_steps} steps = "
                f"{self.wall_s / 3600:.1f} h"
                f" wall, {self.gpu_hours:.1f} GPU-hours{limit} (no validation or sampling time: a run measures"
                f" them, measured.json's phase_time;"
                f" {self.throughput.source}{'; ' + self.layout if self.layout else ''}){split}")


@dataclass(frozen=True)
class LoaderRate:
    """How fast voxdiff's training loader delivers volumes from one CPU core (the main process, or one DataLoader
    worker), per ``data.cache`` mode, at ``voxels`` per volume (:func:`loader_rate`).

    Attributes:
        volumes_per_s: per cache mode (``none``: decompress and transform every volume; ``disk``: read the cached
            tensors; ``memory``: copy the cached tensors into the batch).
        voxels: the volume the rates were measured at; another volume scales them by its voxels.
        source: the measurement.
    """

    volumes_per_s: Mapping[str, float]
    voxels: int
    source: str

    def per_s(self, cache: str, workers: int, voxels: int) -> float | None:
        """Volumes per second with ``workers`` DataLoader workers (0: the main process), or None where this cache
        mode was not measured. Workers are assumed to scale linearly (each on a core of its own)."""
        rate = self.volumes_per_s.get(cache)
        return None if rate is None else rate * self.voxels / voxels * max(1, workers)


NIFTI_LOADER = LoaderRate(
    {"none": 0.43, "disk": 4.77, "memory": 8.04}, 160 * 256 * 256,
    "bench/bench_data.py on a 2-core VM shared with other jobs, 0 workers: none and disk at 160x256x256 one volume a "
    "batch, memory at 160x128x128 in batches of 32 (32.2 volumes/s; a new batch tensor of 640 MiB a step): a lower "
    "bound of one core's rate")
PHANTOM_LOADER = LoaderRate(
    {"memory": 6.18}, 160 * 256 * 256,
    "bench/bench_data.py --caches phantom: the built-in phantom kept in memory at 160x128x128 in batches of 32 "
    "(24.7 volumes/s), 0 workers, on a 2-core VM: a lower bound of one core's rate")
"""The built-in phantom (``data.root=null``) generated once and kept in memory (``data.cache=memory``); generated
again at every access otherwise, which is not measured."""
DATA_SLACK = 0.05
"""The share of a step that waiting for data may add before :func:`data_too_slow` names it."""


def loader_rate(data: Mapping[str, Any], workers: int, volume: tuple[int, ...]) -> float | None:
    """Volumes per second an image run's training loader delivers to one rank (:data:`NIFTI_LOADER` for a NIfTI
    folder, :data:`PHANTOM_LOADER` for the phantom, per ``data.cache``), or None where it was not measured (a
    latent run, whose latents are small beside its step; the phantom generated at every access)."""
    table = loader_table(data)
    return None if table is None else table.per_s(str(data.get("cache", "memory")), workers, math.prod(volume))


def loader_table(data: Mapping[str, Any]) -> LoaderRate | None:
    """The measured rates of this data module's loader (None: a latent run's, not measured). Subjects made from a
    template (``data=mni_template``) are written as NIfTI and read through the NIfTI path."""
    target = str(data.get("_target_", ""))
    if target.endswith("LatentDataModule"):
        return None
    if data.get("root") is None and not target.endswith("MNITemplateDataModule"):
        return PHANTOM_LOADER
    return NIFTI_LOADER


def data_step_s(step_s: float | None, batch: int, rate: float | None, workers: int) -> float | None:
    """Seconds per step with its data: with DataLoader workers, they load the next batches while the GPU runs
    (``max(step_s, batch / rate)``); with none, the main process loads each batch between steps (``step_s +
    batch / rate``: measured on an H100, reference/h100_session19_e11_b32_measured.json). ``rate``: the loader's
    volumes/s for one rank (:func:`loader_rate`; None: not measured, the step alone)."""
    if step_s is None or rate is None:
        return step_s
    load_s = batch / rate
    return step_s + load_s if workers <= 0 else max(step_s, load_s)


def waits_for_data(step_s: float | None, wall_s: float | None) -> bool:
    """Whether the wait for data (``wall_s``: the step with it, :func:`data_step_s`) adds more than
    :data:`DATA_SLACK` of the step ``step_s``."""
    return step_s is not None and wall_s is not None and wall_s > step_s * (1 + DATA_SLACK)


def data_too_slow(data: Mapping[str, Any], batch: int, workers: int, volume: tuple[int, ...],
                  step_s: float | None) -> str | None:
    """A warning when waiting for data adds more than :data:`DATA_SLACK` of a step (:func:`data_step_s`, the
    loader's rate by :func:`loader_rate`, the step's by the time model), with the fix; else None."""
    rate = loader_rate(data, workers, volume)
    wall = data_step_s(step_s, batch, rate, workers)
    if step_s is None or rate is None or wall is None or not waits_for_data(step_s, wall):
        return None
    cache = str(data.get("cache", "memory"))
    source = loader_table(data).source  # type: ignore[union-attr]  # a rate came from it
    one_core = rate / max(1, workers)
    enough = max(1, math.ceil(batch / step_s / one_core))
    fixes = f"data.num_workers={enough} or more" + (" (they load the next batches while the GPU runs)"
                                                    if workers == 0 else "")
    if cache != "memory":
        fixes = f"data.cache=memory (checked against host memory above), or {fixes}"
    if workers <= 0:
        return (f"data: with data.num_workers=0 the main process loads each batch between steps: about "
                f"{batch / rate * 1e3:.0f} ms a step at {rate:.1f} volumes/s with data.cache={cache}, beside the "
                f"step's {step_s * 1e3:.0f} ms predicted, so {wall * 1e3:.0f} ms a step ({source}). Fix: {fixes}")
    return (f"data: the loader with data.cache={cache} and data.num_workers={workers} delivers about {rate:.1f} "
            f"volumes/s, the step consumes {batch / step_s:.1f} samples/s per GPU: the GPU would wait for data "
            f"({source}). Fix: {fixes}")


# ------------------------------------------------------------------------------------------- one run, from a config
@dataclass(frozen=True)
class RunNeeds:
    """Disk, host memory and time of one run, and what of it does not fit (:func:`run_needs`).

    Attributes:
        disk: the checkpoints against the run directory's file system; None when the run keeps no checkpoint.
        host: host memory of one node; None when the data module caches nothing.
        time: the predicted run time; None with ``time_unknown`` saying why.
        cost: the step's FLOPs and operator calls (None: not counted); step_s: its predicted seconds on the GPU
            (None: its throughput was not measured), whether or not the run has an end; :attr:`wall_step_s`: with
            the wait for data.
        misfits: what does not fit, each naming the key, the value and a fix (the preflight refuses the run).
        warnings: what may not fit (kept checkpoints).
    """

    disk: DiskNeed | None
    host: HostNeed | None
    time: RunTime | None
    time_unknown: str = ""
    misfits: tuple[Any, ...] = ()
    warnings: tuple[str, ...] = ()
    cost: StepCost | None = None  # the step's FLOPs and operator calls, when counted
    step_s: float | None = None  # predicted seconds per step, where the GPU's throughput was measured
    loader_per_s: float | None = None  # volumes/s the data loader delivers per rank (loader_rate); None: not limited
    num_workers: int = 0  # data.num_workers: 0, the main process loads each batch between steps
    batch_size: int = 1

    @property
    def wall_step_s(self) -> float | None:
        """Seconds per step with its data (:func:`data_step_s`): what a run's step takes on the GPU's clock."""
        return data_step_s(self.step_s, self.batch_size, self.loader_per_s, self.num_workers)

    def lines(self) -> list[str]:
        out = []
        if self.disk is not None:
            out.append("disk: " + self.disk.describe())
        if self.host is not None:
            out.append(self.host.describe())
        out.append(self.time.describe() if self.time is not None else f"time: {self.time_unknown}")
        return out


def slurm_site(resources: Mapping[str, Any] | None) -> dict[str, str] | None:
    """The Slurm job of an experiment: ``slurm/site.env`` under the experiment's ``slurm:`` overrides
    (``resources``), or None when the experiment has no job (``slurm: null``) or the repository's
    ``slurm/site.env`` is not here."""
    site = config_dir().parent / "slurm" / "site.env"
    if resources is None or not site.is_file():
        return None
    return {**read_site_env(site), **{str(k): str(v) for k, v in dict(resources).items()}}


def run_needs(run: Any, model: torch.nn.Module, *, ema: bool, data: Any, sample_bytes: int, processes_per_node: int,
              world_size: int, cost: StepCost | None, gpu: str, kind: str, env: Mapping[str, str],
              latent_shape: tuple[int, ...] | None = None) -> RunNeeds:
    """Disk, host memory and time of a run.

    Args:
        run: its :class:`~voxdiff.run.spec.RunSpec`: its ``resources`` (``paths.run_dir``, ``callbacks.best/last``,
            ``data.*``, ``trainer.max_steps``, ``slurm``), its batch and volume, and its ``preflight`` options
            (``disk_free_gib`` / ``host_memory_gib`` to plan for another machine).
        model: the UNet on the meta device (its ``state_dict`` is what a checkpoint holds).
        ema: whether the checkpoint holds the EMA's shadow.
        data: the data module's cached bytes per rank (:class:`DataMemory`) or None.
        sample_bytes: bytes of one training sample as the DataLoader hands it over (what workers hold ahead).
        processes_per_node, world_size: ranks on one node, and in all (each rank is one GPU).
        cost: the step's FLOPs and operator calls (None: no time prediction).
        gpu: the GPU type the run is planned for (a key of :data:`STEP_THROUGHPUT`).
        kind: the step's :func:`step_kind` (eager, compiled, or compiled with CUDA graphs), which picks the throughput.
        env: the process environment (a running Slurm job's memory).
        latent_shape: ``(C, d, h, w)`` of one modality's latents, for a run on a latent cache (its bytes on disk).
    """
    misfits: list[ConfigError] = []
    warnings: list[str] = []

    # disk: the checkpoints, under the run directory
    needs, options = run.resources, run.preflight
    guide = needs.guide_step
    if guide is not None and 0 < needs.max_steps <= guide:  # the snapshot would be the trained model, or never taken
        warnings.append(f"callbacks.guide.step={guide} is not before trainer.max_steps={needs.max_steps}: the run "
                        "keeps no earlier model to guide with, and its commands sample without autoguidance. Fix: "
                        + (f"e.g. callbacks.guide.step={max(1, needs.max_steps // 3)} (a third of the run)"
                           if needs.max_steps > 1 else "callbacks.guide.step=null (one step has no earlier model)"))
        guide = None if guide > needs.max_steps else guide
    kept = kept_checkpoints(needs.best_top_k, needs.keep_last, guide is not None)
    disk = None
    if kept != 0:
        run_dir = needs.run_dir
        free, where = free_bytes(run_dir)
        configured = options.disk_free_gib
        if configured is not None:
            free, where = int(float(configured) * GiB), Path(f"{run_dir} (preflight.disk_free_gib)")
        cache = subjects = None
        if latent_shape is not None:
            subjects = getattr(data, "subjects", None)
            cache = latent_cache_nbytes(subjects or 1, latent_shape, tuple(run.shapes.volume))
        disk = DiskNeed(checkpoint_nbytes(model.state_dict().values(), model.parameters(), ema=ema), kept, free,
                        where, cache, subjects)
        if not disk.write_fits:
            misfits.append(ConfigError(
                "paths.run_dir", run_dir, f"{size(disk.free)} free under {where}, and writing a checkpoint "
                f"atomically needs {size(2 * disk.checkpoint)} (the previous {size(disk.checkpoint)} checkpoint and "
                "the new one side by side)", "point paths.run_dir at a file system with room, or free space there"))
        elif not disk.kept_fits:
            keys = "callbacks.best.save_top_k, callbacks.last" + (", callbacks.guide.step" if guide is not None
                                                                   else "")
            warnings.append(f"the kept checkpoints ({'every one' if kept is None else kept} of "
                            f"{size(disk.checkpoint)}: {keys}) will not all fit the {size(disk.free)} free under "
                            f"{where}")

    # host memory: the data cache of every rank of a node, and the batches the workers hold ahead
    host = None
    per_rank = getattr(data, "per_rank_bytes", None)
    if per_rank:
        configured = options.host_memory_gib
        job = slurm_job_memory(env)
        site = slurm_site(needs.slurm)
        if configured is not None:
            budget, source = int(float(configured) * GiB), "preflight.host_memory_gib"
        elif job is not None:
            budget, source = job, "this Slurm job's allocation"
        elif site is not None and site.get("MEM_PER_GPU"):
            budget = parse_slurm_memory(site["MEM_PER_GPU"]) * processes_per_node
            source = f"Slurm --mem-per-gpu={site['MEM_PER_GPU']} x {processes_per_node} GPU(s) per node"
        else:
            budget, source = host_memory_bytes(), "this machine"
        workers = worker_bytes(sample_bytes, run.batch_size, needs.num_workers, needs.prefetch_factor,
                               processes_per_node)
        host = HostNeed(per_rank * processes_per_node, workers, budget, source)
        if not host.fits:
            misfits.append(ConfigError(
                "data.cache", needs.data.get("cache") or "memory",
                f"the data the ranks of one node cache and load ahead take {size(host.total)}, more than the "
                f"{size(host.budget)} of host memory ({source})",
                "use data.cache=disk (or none), fewer DataLoader workers, or more memory per node"))

    # time: the step's FLOPs on a GPU whose speed was measured, and the wait for data
    run_time, unknown = None, ""
    rate = loader_rate(needs.data, needs.num_workers, tuple(run.shapes.volume))
    throughput = STEP_THROUGHPUT.get((gpu, kind))
    step_s = throughput.seconds(cost) if cost is not None and throughput is not None else None
    wall_s = data_step_s(step_s, run.batch_size, rate, needs.num_workers)
    max_steps = needs.max_steps
    unet = run.system.unet
    layout = CHANNELS_LAST_TIME if unet is not None and unet.channels_last else ""
    if cost is None:
        unknown = "not predicted for this step"
    elif throughput is None:
        unknown = (f"the {kind} step's speed on {gpu} has not been measured (voxdiff.preflight.resources."
                   f"STEP_THROUGHPUT has {', '.join(f'{g} {k}' for g, k in sorted(STEP_THROUGHPUT))})")
    elif not isinstance(max_steps, int) or max_steps <= 0:
        unknown = (f"{wall_s * 1e3:.0f} ms/step predicted{f' ({layout})' if layout else ''}; "
                   f"trainer.max_steps={max_steps} sets no end; the step: {describe_parts(throughput.parts(cost))}")
    else:
        site = slurm_site(needs.slurm)
        limit = warn = None
        if site is not None and site.get("TIME"):
            try:
                limit = parse_slurm_time(site["TIME"])
            except ValueError:
                limit = None  # UNLIMITED: no requeues to plan
            warn = float(site.get("WARN_SECONDS") or 0)
        run_time = RunTime(wall_s, max_steps, world_size, limit, warn or 0.0, throughput, step_s,
                           throughput.parts(cost), layout)
    slow = data_too_slow(needs.data, run.batch_size, needs.num_workers, tuple(run.shapes.volume), step_s)
    if slow:
        warnings.append(slow)
    return RunNeeds(disk, host, run_time, unknown, tuple(misfits), tuple(warnings), cost, step_s, rate,
                    needs.num_workers, run.batch_size)
