"""The preflight of one configuration traces the step that ``train.py`` runs: the EMA as ``system.ema`` says,
clipping and the non-finite guard, the precision the trainer would pick, and a batch size it refuses to guess."""

from __future__ import annotations

import pytest
import torch

from voxdiff.config import build_encoding, build_model
from voxdiff.errors import ConfigError
from voxdiff.preflight.check import run_preflight
from voxdiff.preflight.memory import predict_memory
from voxdiff.preflight.tracker import round_block


def _weight_bytes(cfg) -> int:
    with torch.device("meta"):
        model = build_model(cfg, build_encoding(cfg), device_type="cuda")
    return sum(round_block(p.numel() * 4) for p in model.parameters())


def test_ema_false_traces_no_ema_copy(tiny_cfg):
    """``system.ema: false`` means no EMA: the trace holds one parameter copy less than with the default EMA."""
    with_ema = predict_memory(tiny_cfg(), compile=False)  # the eager step: the EMA copy does not depend on it
    without = predict_memory(tiny_cfg("system.ema=false"), compile=False)
    weights = _weight_bytes(tiny_cfg())
    assert with_ema.steady_step.forward - without.steady_step.forward == weights
    assert with_ema.first_step.forward - without.first_step.forward == weights


def test_trace_runs_clipping_and_the_nonfinite_guard(tiny_cfg, monkeypatch):
    """Training clips (trainer.gradient_clip_val) and records the finiteness of the loss and of the gradient norm
    every step (on the device); the traced step does the same, twice (step 1 and the steady step)."""
    clip_calls, finite_calls = [], []
    clip, isfinite = torch.nn.utils.clip_grads_with_norm_, torch.isfinite

    def spy_clip(parameters, max_norm, *args, **kwargs):
        clip_calls.append(float(max_norm))
        return clip(parameters, max_norm, *args, **kwargs)

    def spy_isfinite(x):
        finite_calls.append(tuple(x.shape))
        return isfinite(x)

    monkeypatch.setattr(torch.nn.utils, "clip_grads_with_norm_", spy_clip)
    monkeypatch.setattr(torch, "isfinite", spy_isfinite)
    predict_memory(tiny_cfg("trainer.gradient_clip_val=0.5"))
    assert clip_calls == [0.5, 0.5]
    assert finite_calls.count(()) >= 4  # the loss and the gradient norm (scalars) of each traced step


@pytest.mark.parametrize("value", [0, "null", -2])
def test_batch_size_that_is_not_positive_is_refused(tiny_cfg, value):
    cfg = tiny_cfg(f"data.batch_size={value}")
    with pytest.raises(ConfigError, match=r"data\.batch_size=.*Fix: "):
        predict_memory(cfg)
    result = run_preflight(cfg, suggest=False)
    assert not result.ok and [p.key for p in result.problems] == ["data.batch_size"]


def test_batch_size_is_traced_as_given(tiny_cfg):
    one = predict_memory(tiny_cfg("data.batch_size=1"), compile=False)
    three = predict_memory(tiny_cfg("data.batch_size=3"), compile=False)
    assert three.input_shape[0] == 3 and one.input_shape[0] == 1
    assert three.first_step.forward > one.first_step.forward


def test_the_preflight_imports_no_lightning(repo):
    """The preflight runs on a login node: neither importing it nor predicting a config (the latent one builds a
    VQ-VAE encoding; one rank of FSDP, whose module also wraps DDP's rank) imports Lightning. The import-linter
    contract (tests/test_layers.py) holds the same for every import statement; this runs it."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import voxdiff.preflight\n"
        "gone = lambda: [m for m in ('lightning', 'pytorch_lightning') if m in sys.modules]\n"
        "assert not gone(), gone()\n"
        "from voxdiff.config import compose\n"
        "from voxdiff.preflight.check import run_preflight\n"
        "for extra in ([], ['trainer=fsdp', 'trainer.devices=4']):\n"
        "    r = run_preflight(compose('preflight', ['experiment=exp9_ldm_8x_bravo', 'model=3L_tiny', *extra]),\n"
        "                      suggest=False, phases=not extra)  # one rank's validation and sampling: as one GPU's\n"
        "    assert r.ok and r.report is not None, r.problems\n"
        "assert not gone(), gone()\n"
        "print('light')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "light" in result.stdout, result.stderr[-2000:]


@pytest.mark.parametrize("override, want", [
    ("model.compile=true", "compiled"),
    ("model.compile=false", "eager"),
    ("model.compile_backend=aot_eager", "eager"),  # no inductor: the eager step's memory
])  # fmt: skip
def test_the_step_predicted_is_the_one_the_gpu_run_compiles(tiny_cfg, override, want):
    assert predict_memory(tiny_cfg(override)).model_step == want


def test_a_rectified_flow_step_is_predicted_compiled_with_its_float_timesteps(tiny_cfg):
    """Rectified flow calls the UNet with float32 timesteps, DDPM with int64: the compiled profile is traced for the
    process's own (traced for int64, the rflow step fell back to the eager upper bound)."""
    import torch

    from voxdiff.diffusion import RectifiedFlow, RFlowSettings
    from voxdiff.diffusion.processes import timestep_dtype

    report = predict_memory(tiny_cfg("model.compile=true", "diffusion=rflow"))
    assert report.model_step == "compiled" and not any("could not be predicted" in n for n in report.notes)
    seen = []
    RectifiedFlow(RFlowSettings()).loss(lambda x, timesteps: seen.append(timesteps.dtype) or x[:, :1],
                                        torch.zeros(2, 1, 4, 4, 4))
    assert seen == [timestep_dtype(RFlowSettings())] == [torch.float32]


@pytest.mark.parametrize("value", ["yes", 1])
def test_a_compile_setting_that_means_nothing_is_refused(tiny_cfg, value):
    problems = run_preflight(tiny_cfg(f"model.compile={value}"), suggest=False).problems
    assert any(isinstance(p, ConfigError) and "model.compile" in str(p) and "model.compile=auto" in str(p)
               for p in problems), problems


def test_the_gpu_run_is_predicted_compiled_unless_told(tiny_cfg):
    """model.compile=auto: a GPU run compiles, so the prediction is of the compiled step; eager on request."""
    cfg = tiny_cfg()
    compiled, eager = predict_memory(cfg), predict_memory(cfg, compile=False)
    assert (compiled.model_step, eager.model_step) == ("compiled", "upper bound (eager)")  # eager: its upper bound
    assert any("traced eagerly" in n for n in eager.notes)
    assert compiled.steady_step.forward < eager.steady_step.forward
    assert run_preflight(cfg, suggest=False, compile=False).report.model_step == "upper bound (eager)"
    assert run_preflight(tiny_cfg("model.compile=false"), suggest=False).report.model_step == "eager"


def test_with_cuda_graphs_validation_and_sampling_need_the_graphs_pool_beside_them(monkeypatch) -> None:
    """On a GPU exp11 replays CUDA graphs (``model.compile_mode=auto``): their pool keeps its segments while
    validation and sampling run the model eagerly, so the verdict counts each of those peaks with the pool beside
    it, and the training step by its reserved estimate (two pools); in torch's default compile mode, by the
    allocated peaks alone."""
    from voxdiff.config import compose

    monkeypatch.setenv("VOXDIFF_TARGET", "gpu")
    graphs = run_preflight(compose("preflight", ["experiment=exp11"]), suggest=False, compile=False, timing=False)
    rep = graphs.report
    assert rep.cuda_graphs and 0 < rep.graph_pool_bytes < rep.estimated_reserved
    eager = max(graphs.phases.validation, graphs.phases.sampling)
    assert rep.graph_pool_needed > rep.graph_pool_bytes  # budgeted above its simulation (GRAPH_POOL_MEASURED_RATIO)
    assert graphs.per_gpu_peak_gib * 2**30 == max(rep.peak_needed, eager + rep.graph_pool_needed)
    assert graphs.peak_phase in ("validation", "sampling") and eager + rep.graph_pool_needed > rep.peak_needed
    # the pool, budgeted at the most a measured one exceeded its simulation, gets no safety margin again
    held = rep.graph_pool_needed
    assert graphs.need_gib * 2**30 == pytest.approx(
        (graphs.per_gpu_peak_gib * 2**30 - held) * (1 + graphs.margin) + held + rep.cuda_context_bytes)
    assert graphs.need_gib * 2**30 < graphs.per_gpu_peak_gib * 2**30 * (1 + graphs.margin) + rep.cuda_context_bytes
    default = run_preflight(compose("preflight", ["experiment=exp11", "model.compile_mode=null"]), suggest=False,
                            compile=False, timing=False)
    assert not default.report.cuda_graphs and default.report.graph_pool_bytes == 0
    assert default.per_gpu_peak_gib * 2**30 == default.phases.peak_allocated
    assert graphs.need_gib > default.need_gib
