"""``preflight.measure=true`` runs the step the preflight traces: the same plan, as a real TrainStep. Here on the CPU
(the CUDA peak statistics need a GPU; ``tests/cli/test_preflight.py`` checks the refusal without one)."""

from __future__ import annotations

import torch

from voxdiff.preflight.memory import traced_recipe
from voxdiff.benchmarks.measure import measured_step
from voxdiff.run.spec import run_spec
from voxdiff.step import ClipSettings


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
