"""Measure the real peak GPU memory of training steps, beside the prediction (``preflight.measure=true``).

Runs the step that :func:`voxdiff.preflight.memory.predict_memory` traces — the same
:class:`voxdiff.step.TrainStep`, made from the same run spec (model factory, recipe by
:func:`~voxdiff.preflight.memory.traced_recipe`: loss, AdamW, gradient order, clipping and the guard, EMA; the batch
of the data module, :attr:`voxdiff.run.spec.RunSpec.batch`) — with real CUDA
autocast as its precision context, on a CUDA GPU, resetting the peak statistics at each phase, and writes rows in
the format of ``reference/measured_vram.csv`` plus the prediction, so anyone with a GPU can extend the reference.
"""

from __future__ import annotations

import csv
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from voxdiff.config import compose
from voxdiff.errors import ConfigError
from voxdiff.models.unet import build_unet_from_spec
from voxdiff.preflight.memory import MemoryReport, traced_recipe
from voxdiff.run.spec import RunSpec, run_spec
from voxdiff.step import TrainStep
from voxdiff.units import GiB

MEASURED_COLUMNS = ["model_gib", "fwd_gib", "bwd_gib", "total_gib", "steady_fwd_gib", "steady_bwd_gib",
                    "steady_total_gib", "reserved_gib", "oom"]


class CudaPhasePeaks:
    """The :class:`~voxdiff.step.PhaseProbe` of the measure mode: ``torch.cuda.max_memory_allocated()`` of each
    phase after a reset at its start, in bytes."""

    def __init__(self) -> None:
        self.peaks: dict[str, int] = {}

    def begin(self, phase: str) -> None:
        torch.cuda.reset_peak_memory_stats()

    def end(self, phase: str) -> None:
        self.peaks[phase] = torch.cuda.max_memory_allocated()


class DevicePeak:
    """``with DevicePeak(device) as peak: ...``: on a CUDA device, the peak ``torch.cuda.max_memory_allocated`` of
    the block (synchronised, reset at its start; what is on the device before it counts), in :attr:`bytes`; None
    elsewhere (the CPU has no peak statistics)."""

    def __init__(self, device: Any) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self.bytes: int | None = None

    def __enter__(self) -> DevicePeak:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            self.bytes = torch.cuda.max_memory_allocated()


def experiment_on(experiment: str, device: str, overrides: list[str]) -> tuple[Any, RunSpec]:
    """The train config of ``experiment`` on one device of type ``device`` (``cuda`` or ``cpu``), ``overrides``
    applied, and its run spec resolved for that device: what the bench scripts that measure a command's memory
    build their system from."""
    cfg = compose("train", [f"experiment={experiment}", f"trainer.accelerator={'gpu' if device == 'cuda' else 'cpu'}",
                            "trainer.devices=1", *overrides])
    return cfg, run_spec(cfg, device)


def device_banner(script: str, device: str) -> str:
    """``SCRIPT on <GPU name>, torch X`` (``CPU: predictions only`` without CUDA): a measuring script's first line."""
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU: predictions only"
    return f"{script} on {name}, torch {torch.__version__}"


class AllocationHistory:
    """``with AllocationHistory(device) as history: ...``: on a CUDA device, the caching allocator's record of the
    block's allocations and frees, each allocation with its Python and C++ frames
    (``torch.cuda.memory._record_memory_history``), in :attr:`entries` for :func:`live_at_peak`; elsewhere nothing
    is recorded and :attr:`entries` stays empty. Recording costs a few microseconds per allocation: time nothing
    inside it."""

    def __init__(self, device: Any, max_entries: int = 2_000_000) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self.max_entries = max_entries
        self.entries: list[dict[str, Any]] = []

    def __enter__(self) -> AllocationHistory:
        if self.cuda:
            record = torch.cuda.memory._record_memory_history
            try:
                record("all", context="alloc", stacks="all", max_entries=self.max_entries, clear_history=True)
            except TypeError:  # a torch without clear_history: the block's entries are told apart by live_at_peak
                record("all", context="alloc", stacks="all", max_entries=self.max_entries)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            snapshot = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(None)
            traces = snapshot.get("device_traces", [])
            device = torch.cuda.current_device()
            self.entries = list(traces[device]) if device < len(traces) else []


def reserved_by_pool(snapshot: Mapping[str, Any]) -> dict[str, dict[str, int]]:
    """The caching allocator's segments per memory pool, from ``torch.cuda.memory._snapshot()``: ``default`` (the
    pool every allocation outside a CUDA graph uses) and ``private <id>`` (a CUDA graph's private pool: cudagraph
    trees share one per device). Per pool: ``segments``, ``reserved`` (their cudaMalloc'd bytes), ``allocated``
    (in blocks a tensor holds now), and ``largest_free`` (the largest inactive block). What the preflight's two-pool
    estimate (``graph_pool_bytes`` and the rest) is held against, pool by pool.

    Args:
        snapshot: a dict with ``segments``, each with ``segment_pool_id`` (``(0, 0)``: the default pool),
            ``total_size``, ``allocated_size`` and ``blocks`` (``size``, ``state``).
    """
    pools: dict[str, dict[str, int]] = {}
    for seg in snapshot.get("segments", []):
        p = pools.setdefault(pool_name(seg.get("segment_pool_id")),
                             {"segments": 0, "reserved": 0, "allocated": 0, "largest_free": 0})
        p["segments"] += 1
        p["reserved"] += int(seg["total_size"])
        p["allocated"] += int(seg.get("allocated_size", 0))
        free = [int(b["size"]) for b in seg.get("blocks", []) if b.get("state") == "inactive"]
        p["largest_free"] = max([p["largest_free"], *free])
    return pools


def pool_name(pool_id: Any) -> str:
    """A memory pool's name as :func:`reserved_by_pool` writes it: ``default`` for ``(0, 0)`` (or none given),
    ``private a.b`` for a CUDA graph's private pool."""
    pool_id = tuple(pool_id or (0, 0))
    return "default" if pool_id == (0, 0) else f"private {pool_id[0]}.{pool_id[1]}"


@dataclass(frozen=True)
class SegmentGrowth:
    """What :func:`segment_growth` finds: the allocations that made the caching allocator reserve new segments.

    Attributes:
        grown: ``(pool, site, bytes, segments)``: the segments reserved (``cudaMalloc``), grouped by their pool
            (:func:`pool_name`) and by the site of the allocation that asked for them (:func:`allocation_site`),
            largest first.
        released: bytes of segments given back (``cudaFree``: ``empty_cache``, or the allocator freeing cached
            segments to retry an allocation that did not fit).
    """

    grown: tuple[tuple[str, str, int, int], ...]
    released: int

    def by_pool(self) -> dict[str, int]:
        """Bytes of segments reserved per pool, by pool name."""
        pools: dict[str, int] = {}
        for pool, _, size, _ in self.grown:
            pools[pool] = pools.get(pool, 0) + size
        return dict(sorted(pools.items()))

    def describe(self, top: int = 12) -> str:
        """The segments reserved per pool, and the ``top`` largest sites, one per line, in MiB."""
        lines = ["segments reserved within the record: " + (", ".join(
            f"{pool} {size / 2**30:.2f} GiB" for pool, size in self.by_pool().items()) or "none")
            + f"; released {self.released / 2**30:.2f} GiB"]
        lines += [f"  {size / 2**20:10.1f} MiB {n:4d} segments  {pool:>14}  {site}"
                  for pool, site, size, n in self.grown[:top]]
        return "\n".join(lines)


def segment_growth(entries: Iterable[Mapping[str, Any]]) -> SegmentGrowth:
    """Which allocations of a recorded history (:class:`AllocationHistory`) made the caching allocator reserve
    segments, pool by pool: where a step's reserved memory outgrows its allocated peak (a CUDA graph's private pool,
    a cuDNN workspace that fits no cached block), this names the requests that grew it.

    Args:
        entries: ``torch.cuda.memory._snapshot()["device_traces"][device]``: ``segment_alloc`` and
            ``segment_free`` entries with ``size``, ``frames`` and ``pool_id`` (torch 2.13; a trace without
            ``pool_id`` counts as the default pool); other actions are ignored.
    """
    grown: dict[tuple[str, str], list[int]] = {}
    released = 0
    for e in entries:
        if e.get("action") == "segment_alloc":
            g = grown.setdefault((pool_name(e.get("pool_id")), allocation_site(e.get("frames", []))), [0, 0])
            g[0] += int(e["size"])
            g[1] += 1
        elif e.get("action") == "segment_free":
            released += int(e["size"])
    ranked = sorted(((pool, site, v[0], v[1]) for (pool, site), v in grown.items()), key=lambda t: -t[2])
    return SegmentGrowth(tuple(ranked), released)


@dataclass(frozen=True)
class PeakBlocks:
    """What :func:`live_at_peak` finds: the largest sum of the recorded allocations alive together, and where they
    were made.

    Attributes:
        bytes: that sum (blocks allocated before the record began are not in it: the resident weights).
        sites: ``(site, bytes, blocks)`` of the allocations alive at that moment, grouped by :func:`allocation_site`,
            largest first.
    """

    bytes: int
    sites: tuple[tuple[str, int, int], ...]

    def describe(self, top: int = 12) -> str:
        """The peak and its ``top`` largest sites, one per line, in MiB."""
        lines = [f"allocated within the record, alive together at their peak: {self.bytes / 2**20:.1f} MiB"]
        lines += [f"  {size / 2**20:10.1f} MiB {n:5d} blocks  {site}" for site, size, n in self.sites[:top]]
        return "\n".join(lines)


#: C++ frames of the allocator and of tensor creation, skipped to find the operator that asked for a block
_PLUMBING = re.compile(r"^(c10::|std::|at::(detail|TensorBase|Tensor::|empty|_ops|native::(empty|resize)|\(anonymous|"
                       r"cuda::|meta::|compositeexplicitautograd::|compositeimplicitautograd::)|"
                       r"torch::(autograd|PyTorch|impl)|_PyEval|_PyObject|PyObject|\?\?|cfunction|method_vectorcall)")


def allocation_site(frames: Iterable[Mapping[str, Any]]) -> str:
    """``operator <- file.py:line function`` for a trace entry's frames (innermost first): the first C++ frame that
    is not allocator or tensor-creation plumbing (e.g. ``at::native::cudnn_convolution``), and the first Python frame
    outside torch (the model's or the sampler's line); ``?`` for a part not found."""
    op = py = None
    for f in frames:
        name, filename = str(f.get("name", "")), str(f.get("filename", ""))
        if filename.endswith(".py"):
            if py is None and "/torch/" not in filename:
                py = f"{'/'.join(Path(filename).parts[-2:])}:{f.get('line', '?')} {name}"
        elif op is None and py is None and name and not _PLUMBING.match(name):
            op = name.split("(")[0][:80]
        if op is not None and py is not None:
            break
    return f"{op or '?'} <- {py or '?'}"


def live_at_peak(entries: Iterable[Mapping[str, Any]]) -> PeakBlocks:
    """The allocations of a recorded history (:class:`AllocationHistory`) alive together when their sum peaked.

    Args:
        entries: ``torch.cuda.memory._snapshot()["device_traces"][device]``: dicts with ``action`` (``alloc``,
            ``free_completed``, ...), ``addr``, ``size`` and ``frames``. A free of a block allocated before the
            record is ignored (its bytes are not in the sum).
    """
    entries = list(entries)
    live: dict[int, int] = {}
    total = peak = 0
    at = -1
    for i, e in enumerate(entries):
        if e.get("action") == "alloc":
            live[e["addr"]] = e["size"]
            total += e["size"]
            if total > peak:
                peak, at = total, i
        elif e.get("action") == "free_completed" and e.get("addr") in live:
            total -= live.pop(e["addr"])
    alive: dict[int, Mapping[str, Any]] = {}
    for e in entries[: at + 1]:
        if e.get("action") == "alloc":
            alive[e["addr"]] = e
        elif e.get("action") == "free_completed":
            alive.pop(e.get("addr"), None)  # type: ignore[arg-type]
    sites: dict[str, list[int]] = {}
    for e in alive.values():
        s = sites.setdefault(allocation_site(e.get("frames", [])), [0, 0])
        s[0] += e["size"]
        s[1] += 1
    ranked = sorted(((k, v[0], v[1]) for k, v in sites.items()), key=lambda t: -t[1])
    return PeakBlocks(peak, tuple(ranked))


def against_prediction(predicted_bytes: int, measured_bytes: int | None) -> dict[str, float | None]:
    """A measured peak beside its prediction, in GiB: ``predicted_gib``, ``measured_gib`` and ``error``
    (predicted / measured − 1), the last two None where nothing was measured."""
    measured = None if measured_bytes is None else measured_bytes / GiB
    return {"predicted_gib": predicted_bytes / GiB, "measured_gib": measured,
            "error": None if measured is None else predicted_bytes / GiB / measured - 1}


def peak_cells(row: dict[str, Any]) -> str:
    """:func:`against_prediction`'s fields as the cells of a printed table (``-`` where nothing was measured)."""
    measured = "-" if row["measured_gib"] is None else f"{row['measured_gib']:.3f}"
    error = "-" if row["error"] is None else f"{row['error']:+.1%}"
    return f"{row['predicted_gib']:>13.3f} {measured:>12} {error:>7}"


def measured_step(run: RunSpec) -> tuple[Any, dict[str, tuple[int, ...]]]:
    """The training step the preflight traces (:func:`~voxdiff.preflight.memory.traced_recipe`) on a real device,
    the run spec's (:func:`voxdiff.run.spec.run_spec` resolved for it: the UNet's ``auto`` switches and the
    precision decided there, the local GPU asked for bf16), with real autocast as its precision context and its optimizer configured.

    Returns:
        ``(step, batch)``: a :class:`voxdiff.step.TrainStep` and the shapes of the batch it trains on.
    """
    device_type = run.device_type
    with torch.device(device_type):
        model = build_unet_from_spec(run.unet)
        step = TrainStep(model, traced_recipe(run), encoding=run.encoding.to(device_type), mode=run.mode,
                         precision=run.precision.context(), device_type=device_type)
    step.configure_optimizer()
    return step, run.batch


def require_cuda() -> None:
    """Refuse ``preflight.measure=true`` where no CUDA GPU is visible (before anything is predicted).

    Raises:
        ConfigError: naming ``preflight.measure`` and where to run it.
    """
    if not torch.cuda.is_available():
        raise ConfigError("preflight.measure", True, "needs a CUDA GPU and none is visible",
                          "run it on a GPU node (e.g. srun --gres=gpu:1 python preflight.py ... preflight.measure=true)")


def measure_steps(run: RunSpec, steps: int = 3) -> dict[str, Any]:
    """Run ``steps`` training steps of ``run`` (resolved for ``cuda``) on the current CUDA device; peaks per phase
    in GiB."""
    require_cuda()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    step, batch_spec = measured_step(run)
    out: dict[str, Any] = {"model_gib": torch.cuda.max_memory_allocated() / GiB, "oom": 0}  # weights and EMA
    batch = {k: torch.randn(shape, device="cuda") for k, shape in batch_spec.items()}
    try:
        for i in range(1, steps + 1):
            probe = CudaPhasePeaks()
            step.run(batch, probe)
            torch.cuda.synchronize()
            phases = {k: v / GiB for k, v in probe.peaks.items()}
            prefix = "" if i == 1 else "steady_"
            out.update({f"{prefix}fwd_gib": phases["forward"], f"{prefix}bwd_gib": phases["backward"],
                        f"{prefix}total_gib": max(phases.values())})
        out["reserved_gib"] = torch.cuda.max_memory_reserved() / GiB
    except torch.OutOfMemoryError:
        out["oom"] = 1
    finally:
        del step, batch
        torch.cuda.empty_cache()
    return out


def reference_row(run: RunSpec, name: str, measured: dict[str, Any], report: MemoryReport | None) -> dict[str, Any]:
    """A row in the format of ``reference/measured_vram.csv`` (plus the prediction's columns) for the run spec
    ``run`` that was measured."""
    row: dict[str, Any] = {
        "table": "voxdiff-measure", "name": name, "input_shape": "x".join(map(str, run.shapes.unet_input)),
        **run.unet.to_row(),  # the UNet's columns, read back by UNetSpec.from_row (the sweep)
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "",
    }
    row.update({k: (f"{v:.3f}" if isinstance(v, float) else v) for k, v in measured.items()})
    if report is not None:
        row.update(pred_step1_gib=f"{report.first_step.peak / GiB:.3f}",
                   pred_steady_gib=f"{report.steady_step.peak / GiB:.3f}",
                   pred_params_m=f"{report.params / 1e6:.3f}")
    return row


def write_rows(path: str | Path, rows: list[dict[str, Any]]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    columns: list[str] = []
    for row in rows:
        columns += [c for c in row if c not in columns]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    return path
