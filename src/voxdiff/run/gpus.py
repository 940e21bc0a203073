"""The GPU types the preflight predicts for — one entry each in :data:`GPUS` — and :func:`resolve_gpu`.

A GPU type decides four things of a prediction: the memory budget (``total_bytes``), the cuBLAS workspaces that
``max_memory_allocated`` counts (:attr:`GpuSpec.cublas_workspace_bytes`), whether ``trainer.precision: null`` means
bf16 (:attr:`GpuSpec.bf16`), and whether SDPA takes the FlashAttention-2 kernel (:attr:`GpuSpec.flash_attention`);
the last three follow from the compute capability by torch's own rules, so an entry states only its name, the names
torch reports for it, its memory and its compute capability.

To add a GPU type: one :class:`GpuSpec` in :data:`GPUS` (``torch.cuda.get_device_name()`` gives its alias,
``torch.cuda.get_device_capability()`` its capability, ``nvidia-smi --query-gpu=memory.total`` its memory).

Why a Python table and not a YAML file under ``configs/``: the entries are typed constants that only code reads
(no Hydra composition, no override makes sense for them), the derived figures (workspace, bf16, flash) stay rules
instead of numbers copied per entry, and a table here needs no loader or validator of its own. A run chooses among
them with ``preflight.gpu`` (a config key, validated like every other).

All sizes are bytes; GiB means 2**30 bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from voxdiff.errors import ConfigError
from voxdiff.units import GiB, KiB, MiB

__all__ = ["DEFAULT_GPU", "GPUS", "GPU_KEY", "GpuSpec", "gpu_type", "local_gpu", "resolve_gpu"]

GPU_KEY = "preflight.gpu"
DEFAULT_GPU = "H100"
"""The GPU predicted for when neither ``preflight.gpu`` nor a local CUDA device names one: the GPU of the
reference measurements (``reference/h100_measured.csv``)."""


@dataclass(frozen=True)
class GpuSpec:
    """A GPU type as far as the memory estimate is concerned.

    Attributes:
        name: the key of :data:`GPUS` (what ``preflight.gpu`` and ``slurm/site.env``'s ``GPU_TYPE`` take), or the
            device's own name for a local GPU that is not in the table.
        total_bytes: device memory as the driver reports it (``nvidia-smi --query-gpu=memory.total``): the budget.
        capability: CUDA compute capability ``(major, minor)``.
        aliases: the names ``torch.cuda.get_device_name()`` reports for this type.
        description: one line for reports (model, memory, architecture).
    """

    name: str
    total_bytes: int
    capability: tuple[int, int]
    aliases: tuple[str, ...] = ()
    description: str = ""

    @property
    def total_gib(self) -> float:
        return self.total_bytes / GiB

    @property
    def sm(self) -> str:
        """``sm90``, ``sm80``, ..."""
        return f"sm{self.capability[0]}{self.capability[1]}"

    @property
    def cublas_workspace_bytes(self) -> int:
        """cuBLAS workspace per (handle, stream). torch 2.13's ``CublasHandlePool.cpp`` defaults to
        ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (8 x 4 MiB = 32 MiB) on sm90 and to ``:4096:2:16:8`` (2 x 4 MiB +
        8 x 16 KiB) elsewhere; the workspace is taken from the caching allocator, so ``max_memory_allocated``
        counts it. A training step uses two handles: the main thread's (forward, optimizer) and the autograd
        engine's device thread (backward)."""
        return 8 * 4 * MiB if self.capability == (9, 0) else 2 * 4 * MiB + 8 * 16 * KiB

    @property
    def bf16(self) -> bool:
        """Whether the GPU computes in bf16 (sm80 and later), which decides ``trainer.precision: null``
        (:func:`voxdiff.step.decide_precision`)."""
        return self.capability >= (8, 0)

    @property
    def flash_attention(self) -> bool:
        """Whether ``F.scaled_dot_product_attention`` can take FlashAttention-2 here (sm80 and later: torch's
        ``sdp_utils`` ``check_flash_attention_hardware_support``); below it SDPA takes another kernel, which the
        preflight traces as the math path (:mod:`voxdiff.preflight.world`)."""
        return self.capability >= (8, 0)

    def describe(self) -> str:
        """``H100 (H100 80GB, sm90, 79.6 GiB)``."""
        what = f"{self.description}, " if self.description else ""
        return f"{self.name} ({what}{self.sm}, {self.total_gib:.1f} GiB)"


def _entry(name: str, mib: int, capability: tuple[int, int], aliases: tuple[str, ...], description: str) -> GpuSpec:
    return GpuSpec(name, mib * MiB, capability, aliases, description)


# Memory: what nvidia-smi reports as memory.total (MiB), which is a little below the vendor's nominal size (the
# driver reserves some; ECC on GDDR6 boards takes 1/16). Sources: NVIDIA's datasheets for the nominal size; the
# figures as reported by nvidia-smi (drivers 550-595) in public reports, e.g. modal-labs/modal-client#2797 (H100
# 81559, A100 80GB 81920, A100 40GB 40960, L40S 46068 MiB). Compute capability: NVIDIA's "CUDA GPUs" list
# (developer.nvidia.com/cuda-gpus).
GPUS: dict[str, GpuSpec] = {spec.name: spec for spec in (
    # H100 datasheet: 80 GB HBM3 (SXM5) / HBM2e (PCIe); Hopper, 9.0
    _entry("H100", 81559, (9, 0), ("NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe"), "H100 80GB"),
    # H200 datasheet: 141 GB HBM3e; Hopper, 9.0; nvidia-smi: 143771 MiB
    _entry("H200", 143771, (9, 0), ("NVIDIA H200",), "H200 141GB"),
    # A100 datasheet: 80 GB HBM2e / 40 GB HBM2; Ampere, 8.0
    _entry("A100", 81920, (8, 0), ("NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe"), "A100 80GB"),
    _entry("A100-40GB", 40960, (8, 0), ("NVIDIA A100-SXM4-40GB", "NVIDIA A100-PCIE-40GB"), "A100 40GB"),
    # L40S datasheet: 48 GB GDDR6 with ECC; Ada Lovelace, 8.9; nvidia-smi (ECC on, the default): 46068 MiB
    _entry("L40S", 46068, (8, 9), ("NVIDIA L40S",), "L40S 48GB"),
    # RTX A6000 datasheet: 48 GB GDDR6 (ECC off by default); Ampere, 8.6; nvidia-smi: 49140 MiB
    _entry("A6000", 49140, (8, 6), ("NVIDIA RTX A6000",), "RTX A6000 48GB"),
    # V100 datasheet: 32 GB HBM2; Volta, 7.0 (no bf16, no FlashAttention-2); nvidia-smi (driver 580): 32768 MiB
    _entry("V100", 32768, (7, 0), ("Tesla V100-SXM2-32GB", "Tesla V100-PCIE-32GB"), "V100 32GB"),
)}


def _known() -> str:
    return ", ".join(GPUS)


def gpu_type(name: Any, key: str = GPU_KEY) -> GpuSpec:
    """The GPU type called ``name``: a key of :data:`GPUS` or one of its aliases (torch's device names), any case.

    Raises:
        ConfigError: naming ``key``, the value, the known types and where to add one.
    """
    text = str(name).strip().lower()
    for spec in GPUS.values():
        if text == spec.name.lower() or text in (a.lower() for a in spec.aliases):
            return spec
    raise ConfigError(key, name, "is not a GPU type the preflight knows",
                      f"use one of {_known()} (or the name torch reports for one of them), or add the type to "
                      "GPUS in src/voxdiff/run/gpus.py")


def local_gpu() -> GpuSpec | None:
    """The current CUDA device as a :class:`GpuSpec`, None without one: its table entry when torch's name for it is
    an alias, with the memory the device itself reports (a MIG slice, a driver that reserves more); else a spec
    built from its properties, named as torch names it."""
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    capability = (int(props.major), int(props.minor))
    try:
        known = gpu_type(props.name)
    except ConfigError:
        return GpuSpec(props.name, int(props.total_memory), capability, (props.name,),
                       "not in voxdiff's GPU table: from its properties")
    return GpuSpec(known.name, int(props.total_memory), capability, known.aliases, known.description)


def resolve_gpu(cfg: Any) -> tuple[GpuSpec, str]:
    """The GPU a run of ``cfg`` is predicted for, and where that came from: ``preflight.gpu`` when the config sets
    it (``"preflight.gpu"``), else the local CUDA device (``"local GPU"``), else :data:`DEFAULT_GPU`
    (``"default"``).

    Raises:
        ConfigError: an unknown ``preflight.gpu`` (:func:`gpu_type`).
    """
    from omegaconf import OmegaConf

    named = OmegaConf.select(cfg, GPU_KEY, default=None) if OmegaConf.is_config(cfg) else None
    if named is not None and str(named).strip():
        return gpu_type(named), GPU_KEY
    local = local_gpu()
    if local is not None:
        return local, "local GPU"
    return GPUS[DEFAULT_GPU], "default"
