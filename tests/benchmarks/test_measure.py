"""``preflight.measure=true`` runs the step the preflight traces: the same plan, as a real TrainStep. Here on the CPU
(the CUDA peak statistics need a GPU; ``tests/cli/test_preflight.py`` checks the refusal without one)."""

from __future__ import annotations

import torch

from voxdiff.preflight.memory import traced_recipe
from voxdiff.benchmarks.measure import measured_step
from voxdiff.run.spec import run_spec
from voxdiff.step import ClipSettings
from voxdiff.units import MiB


class _Phases:
    def __init__(self) -> None:
        self.seen: list[str] = []

    def begin(self, phase: str) -> None:
        self.seen.append(f"<{phase}")

    def end(self, phase: str) -> None:
        self.seen.append(f"{phase}>")


def test_measure_runs_the_planned_step(tiny_cfg):
    cfg = tiny_cfg("system.ema=false", "trainer.gradient_clip_val=0.5", "trainer.precision=32-true")
    step, batch = measured_step(run_spec(cfg, "cpu"))
    assert step.recipe == traced_recipe(run_spec(cfg, "cuda"))  # the recipe the preflight traces
    assert step.ema is None and step.clip == ClipSettings(0.5) and step.guard and step.zero_grad_at == "after_step"
    assert batch == {"image": (1, 1, 16, 32, 32), "mask": (1, 1, 16, 32, 32)}  # the volumes, encoded in the step
    probe = _Phases()
    data = {k: torch.rand(shape) for k, shape in batch.items()}
    stats = [step.run(data, probe) for _ in range(2)]
    assert probe.seen == ["<forward", "forward>", "<backward", "backward>", "<optimizer", "optimizer>"] * 2
    assert all(float(s["grad_norm"]) > 0 for s in stats) and step.steps_done == 2
    with_ema, _ = measured_step(run_spec(tiny_cfg("trainer.precision=32-true"), "cpu"))
    assert with_ema.ema is not None


def test_a_measured_row_is_written_in_the_sweep_format(tiny_cfg):
    """The measure mode's row holds the UNet as UNetSpec.to_row writes it (every level's head size), so the sweep
    reads back the UNet that was measured."""
    from voxdiff.config import model_spec
    from voxdiff.models import UNetSpec
    from voxdiff.benchmarks.measure import reference_row
    from voxdiff.benchmarks.sweep import parse_row

    cfg = tiny_cfg("model.num_head_channels=[8,8,16]")
    row = reference_row(run_spec(cfg, "cuda"), "tiny", {"fwd_gib": 0.5}, None)
    assert row["num_head_channels"] == "8 8 16" and row["input_shape"] == "16x8x16x16" and row["fwd_gib"] == "0.500"
    measured = model_spec(cfg, device_type="cuda")
    assert UNetSpec.from_row(row).monai_kwargs() == measured.monai_kwargs()
    assert parse_row(row).input_shape == (1, 16, 8, 16, 16)


def test_a_peak_beside_its_prediction():
    """The measure scripts' rows (bench/measure_sampling.py, measure_reconstruction.py): the error is predicted over
    measured less one; without a measurement (the CPU) both are None and the table shows dashes; on the CPU a
    DevicePeak measures nothing."""
    from voxdiff.benchmarks.measure import DevicePeak, against_prediction, peak_cells

    gib = 2**30
    row = against_prediction(3 * gib, 2 * gib)
    assert row == {"predicted_gib": 3.0, "measured_gib": 2.0, "error": 0.5}
    assert peak_cells(row).split() == ["3.000", "2.000", "+50.0%"]
    none = against_prediction(gib, None)
    assert none == {"predicted_gib": 1.0, "measured_gib": None, "error": None}
    assert peak_cells(none).split() == ["1.000", "-", "-"]
    with DevicePeak("cpu") as peak:
        pass
    assert peak.bytes is None


def _frames(*names):
    """A trace entry's frames, innermost first: C++ names as they are, ``file.py:line name`` for Python ones."""
    out = []
    for n in names:
        if ".py:" in n:
            where, name = n.split(" ", 1)
            filename, line = where.split(":")
            out.append({"filename": filename, "line": int(line), "name": name})
        else:
            out.append({"filename": "??", "line": 0, "name": n})
    return out


CONV = _frames("c10::cuda::CUDACachingAllocator::Native::NativeCachingAllocator::malloc(...)",
               "at::native::cudnn_convolution_forward(at::Tensor const&)", "at::_ops::convolution::call(...)",
               "/venv/lib/torch/nn/modules/conv.py:720 forward",
               "/venv/lib/monai/networks/blocks/convolutions.py:88 forward")
NORM = _frames("c10::cuda::CUDACachingAllocator::Native::NativeCachingAllocator::malloc(...)",
               "at::native::empty_cuda(...)", "at::(anonymous namespace)::wrapper_CUDA_empty(...)",
               "at::native::native_group_norm(at::Tensor const&)",
               "/venv/lib/monai/networks/nets/diffusion_model_unet.py:301 forward")


def test_live_at_peak_finds_the_blocks_alive_together_at_their_peak_and_where_they_were_made():
    """bench/measure_sampling.py --history: from an allocator history (the format of
    torch.cuda.memory._snapshot()'s device_traces), the largest sum of the recorded blocks alive together, and the
    blocks alive at that moment grouped by the operator and the line that made them; a free of a block allocated
    before the record is ignored."""
    from voxdiff.benchmarks.measure import allocation_site, live_at_peak

    mib = 2**20
    entries = [
        {"action": "free_completed", "addr": 999, "size": 500 * mib},  # allocated before the record began
        {"action": "alloc", "addr": 1, "size": 40 * mib, "frames": NORM},
        {"action": "alloc", "addr": 2, "size": 20 * mib, "frames": CONV},
        {"action": "alloc", "addr": 3, "size": 20 * mib, "frames": CONV},  # peak: 80 MiB
        {"action": "free_requested", "addr": 2, "size": 20 * mib},
        {"action": "free_completed", "addr": 2, "size": 20 * mib},
        {"action": "free_completed", "addr": 3, "size": 20 * mib},
        {"action": "alloc", "addr": 4, "size": 30 * mib, "frames": CONV},  # 70 MiB: below the peak
    ]
    peak = live_at_peak(entries)
    assert peak.bytes == 80 * mib
    conv = "at::native::cudnn_convolution_forward <- blocks/convolutions.py:88 forward"
    norm = "at::native::native_group_norm <- nets/diffusion_model_unet.py:301 forward"
    assert allocation_site(CONV) == conv and allocation_site(NORM) == norm
    assert peak.sites == ((norm, 40 * mib, 1), (conv, 40 * mib, 2))
    text = peak.describe()
    assert "80.0 MiB" in text and conv in text and len(text.splitlines()) == 3
    assert live_at_peak([]).bytes == 0 and allocation_site([]) == "? <- ?"


def test_segment_growth_names_the_allocations_that_reserved_segments_pool_by_pool():
    """bench_gpu_step.py's "history": from an allocator history (torch.cuda.memory._snapshot()'s device_traces, with
    each entry's pool_id as torch 2.13 writes it), the segments reserved grouped by pool and by the allocation that
    asked for them, largest first, and the segments released; what tells a cuDNN workspace from an inductor buffer
    where a CUDA-graph step's reserved memory outgrows its estimate."""
    from voxdiff.benchmarks.measure import segment_growth

    entries = [
        {"action": "segment_alloc", "addr": 1, "size": 64 * MiB, "frames": CONV, "pool_id": (1, 2)},
        {"action": "alloc", "addr": 1, "size": 60 * MiB, "frames": CONV, "pool_id": (1, 2)},
        {"action": "segment_alloc", "addr": 2, "size": 20 * MiB, "frames": NORM, "pool_id": (1, 2)},
        {"action": "segment_alloc", "addr": 3, "size": 32 * MiB, "frames": CONV, "pool_id": (1, 2)},
        {"action": "segment_alloc", "addr": 4, "size": 2 * MiB, "frames": NORM, "pool_id": (0, 0)},
        {"action": "segment_alloc", "addr": 5, "size": 8 * MiB, "frames": NORM},  # no pool_id: the default pool
        {"action": "segment_free", "addr": 2, "size": 20 * MiB, "pool_id": (1, 2)},
    ]
    growth = segment_growth(entries)
    conv = "at::native::cudnn_convolution_forward <- blocks/convolutions.py:88 forward"
    norm = "at::native::native_group_norm <- nets/diffusion_model_unet.py:301 forward"
    assert growth.grown == (("private 1.2", conv, 96 * MiB, 2), ("private 1.2", norm, 20 * MiB, 1),
                            ("default", norm, 10 * MiB, 2))
    assert growth.released == 20 * MiB
    assert growth.by_pool() == {"default": 10 * MiB, "private 1.2": 116 * MiB}
    text = growth.describe()
    assert text.splitlines()[0] == ("segments reserved within the record: default 0.01 GiB, private 1.2 0.11 GiB; "
                                    "released 0.02 GiB")
    assert len(text.splitlines()) == 4 and conv in text
    assert segment_growth([]).describe().startswith("segments reserved within the record: none")


def test_the_allocation_history_records_nothing_on_the_cpu():
    from voxdiff.benchmarks.measure import AllocationHistory

    with AllocationHistory("cpu") as record:
        torch.ones(4)
    assert record.entries == []


def test_reserved_by_pool_separates_the_graphs_private_pool_from_the_default_one():
    """``torch.cuda.memory._snapshot()``'s segments (the format torch documents in ``torch.cuda.memory._snapshot``),
    summed per pool: what the preflight's two-pool estimate of a CUDA-graph step is held against pool by pool."""
    from voxdiff.benchmarks.measure import reserved_by_pool

    def segment(pool, total, blocks):
        return {"segment_pool_id": pool, "total_size": total, "segment_type": "large",
                "allocated_size": sum(size for size, state in blocks if state == "active_allocated"),
                "blocks": [{"size": size, "state": state} for size, state in blocks]}

    snapshot = {"segments": [
        segment((0, 0), 20 * MiB, [(12 * MiB, "active_allocated"), (8 * MiB, "inactive")]),
        segment((0, 0), 2 * MiB, [(2 * MiB, "inactive")]),
        segment((1, 3), 64 * MiB, [(40 * MiB, "active_allocated"), (24 * MiB, "inactive")]),
        segment((1, 3), 32 * MiB, [(32 * MiB, "inactive")]),
    ], "device_traces": []}
    pools = reserved_by_pool(snapshot)
    assert pools == {
        "default": {"segments": 2, "reserved": 22 * MiB, "allocated": 12 * MiB, "largest_free": 8 * MiB},
        "private 1.3": {"segments": 2, "reserved": 96 * MiB, "allocated": 40 * MiB, "largest_free": 32 * MiB},
    }
    assert reserved_by_pool({"segments": []}) == {}
