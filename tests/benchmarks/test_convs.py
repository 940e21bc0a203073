"""``voxdiff.benchmarks.convs``: the convolution calls of a training step, recorded on meta and run alone; and
``bench/bench_convs.py`` end to end on the CPU."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from voxdiff.benchmarks.convs import ConvCall, step_convolutions, time_convolution
from voxdiff.benchmarks.measure import experiment_on
from voxdiff.preflight.check import run_step_cost, traced_unet

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["model=demo_3lvl", "data.volume_shape=[32,32,32]", "data.batch_size=2"]


def _run(*overrides: str):
    return experiment_on("demo", "cpu", [*SMALL, *overrides])[1]


def _conv_modules_called(run) -> int:
    """Forward calls of the UNet's ``nn.Conv3d`` modules over the same traced step, counted by module hooks."""
    calls = 0

    def hook(*_):
        nonlocal calls
        calls += 1

    with torch.device("meta"):
        model = traced_unet(run)
        for m in model.modules():
            if isinstance(m, torch.nn.Conv3d):
                m.register_forward_hook(hook)
        run_step_cost(run, model)
    return calls


def test_every_convolution_of_the_step_is_recorded_with_its_backward():
    """Each forward the UNet's Conv3d modules make is one recorded forward call, and each has one backward; the
    first convolution (of the noisy input, which needs no gradient) computes the weight's gradient only."""
    calls, _ = step_convolutions(_run())
    forwards = sum(n for c, n in calls.items() if c.kind == "forward")
    backwards = {c: n for c, n in calls.items() if c.kind == "backward"}
    assert forwards == _conv_modules_called(_run()) > 20
    assert sum(backwards.values()) == forwards
    assert [c.grads for c in backwards if not c.grads[0]] == [(False, True)]
    first = next(iter(calls))
    assert first.kind == "forward" and first.input[:1] == (2,) and first.input[2:] == (16, 16, 16)


def test_gradient_checkpointing_adds_the_recomputed_forwards():
    """With checkpointing, the backward runs the checkpointed blocks' forwards again: more forward calls (as many
    as the hooks count), the same backwards."""
    plain, _ = step_convolutions(_run("model.gradient_checkpointing=none"))
    checkpointed, _ = step_convolutions(_run("model.gradient_checkpointing=block"))

    def total(calls, kind):
        return sum(n for c, n in calls.items() if c.kind == kind)

    assert total(checkpointed, "forward") > total(plain, "forward")
    assert total(checkpointed, "forward") == _conv_modules_called(_run("model.gradient_checkpointing=block"))
    assert total(checkpointed, "backward") == total(plain, "backward")


def test_the_calls_flops_add_up_to_the_flop_counters_convolutions_of_the_step():
    """The FLOPs of the recorded calls, each counted alone, sum to what torch's flop counter gives the step's
    convolution operators (the preflight's count)."""
    run = _run()
    counter = FlopCounterMode(display=False)
    with torch.device("meta"):
        model = traced_unet(run)
        with counter:
            run_step_cost(run, model)
    by_op = counter.get_flop_counts()["Global"]
    convs = sum(v for op, v in by_op.items() if "convolution" in str(op))
    calls, cost = step_convolutions(run)
    assert sum(c.flop * n for c, n in calls.items()) == pytest.approx(convs, rel=1e-12)
    assert cost.tflop * 1e12 == pytest.approx(counter.get_total_flops(), rel=1e-12)  # the same trace's
    assert convs > 0.9 * counter.get_total_flops()


@pytest.mark.parametrize("layout", ["NCDHW", "NDHWC"])
def test_a_call_computes_what_autograd_computes_in_either_layout(layout):
    """A recorded forward gives ``F.conv3d``'s output and its backward the gradients autograd gives, in either
    layout; the operands are in the layout asked for."""
    fwd = ConvCall("forward", (1, 4, 6, 8, 8), (5, 4, 3, 3, 3), True, (2, 2, 2), (1, 1, 1), (1, 1, 1), False,
                   (0, 0, 0), 1)
    memory_format = torch.channels_last_3d if layout == "NDHWC" else torch.contiguous_format
    x, w, b = fwd.tensors("cpu", torch.float64, memory_format)
    assert x.is_contiguous(memory_format=memory_format) and w.is_contiguous(memory_format=memory_format)
    out = fwd.call((x, w, b))
    assert tuple(out.shape) == fwd.output == (1, 5, 3, 4, 4)
    torch.testing.assert_close(out, F.conv3d(x, w, b, stride=2, padding=1))

    bwd = ConvCall("backward", *[getattr(fwd, f) for f in ("input", "weight", "bias", "stride", "padding",
                                                           "dilation", "transposed", "output_padding", "groups")],
                   grads=(True, True))
    grad, x, w = bwd.tensors("cpu", torch.float64, memory_format)
    gx, gw, gb = bwd.call((grad, x, w))
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    b = torch.zeros(5, dtype=torch.float64, requires_grad=True)
    F.conv3d(x, w, b, stride=2, padding=1).backward(grad)
    torch.testing.assert_close(gx, x.grad)
    torch.testing.assert_close(gw, w.grad)
    torch.testing.assert_close(gb, b.grad)


def test_timing_a_call_and_its_refusals():
    call = ConvCall("forward", (1, 2, 4, 4, 4), (2, 2, 3, 3, 3), False, (1, 1, 1), (1, 1, 1), (1, 1, 1), False,
                    (0, 0, 0), 1)
    assert time_convolution(call, "cpu", torch.float32, "NDHWC", warmup=1, reps=2, rounds=1) > 0
    assert torch.backends.cudnn.benchmark is False  # restored
    with pytest.raises(ValueError, match="layout='NHWC'"):
        time_convolution(call, "cpu", torch.float32, "NHWC")
    with pytest.raises(ValueError, match="reps=0"):
        time_convolution(call, "cpu", torch.float32, "NCDHW", reps=0)


def test_bench_convs_prints_each_setting_against_the_first_and_writes_its_rows(tmp_path):
    """The script on this CPU (tiny, layouts only): the totals per setting with their ratio to the first, measured
    in the same run, and one CSV row per distinct call plus a TOTAL row that sums them."""
    out = tmp_path / "convs.csv"
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_convs.py"), "--experiments", "demo",
                           "--warmup", "1", "--reps", "1", "--rounds", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "NCDHW+autotune left out: cuDNN's autotuner needs a CUDA GPU" in done.stderr
    assert "no GPU figures" in done.stdout
    assert "1.000x NCDHW's" in done.stdout and "NDHWC:" in done.stdout
    rows = list(csv.DictReader(out.open()))
    *calls, total = rows
    assert total["call"] == "TOTAL" and {r["experiment"] for r in rows} == {"demo"}
    assert int(total["count"]) == sum(int(r["count"]) for r in calls)
    for key in ("ms_NCDHW", "ms_NDHWC"):
        assert float(total[key]) == pytest.approx(sum(float(r[key]) * int(r["count"]) for r in calls), rel=1e-3)
    bad = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_convs.py"), "--settings", "NHWC"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert bad.returncode != 0 and "--settings 'NHWC': use LAYOUT or LAYOUT+autotune" in bad.stderr
