"""Tests of the compiled-step prediction (voxdiff.preflight.compiled): against a real inductor compile on the CPU,
against the eager prediction, its fallback and its cache."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from monai.networks.blocks.spatialattention import SpatialAttentionBlock
from monai.networks.nets import DiffusionModelUNet
from monai.networks.nets.diffusion_model_unet import DiffusionUNetResnetBlock
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function

from cpu_allocator import phase_peaks
from voxdiff.models import apply_gradient_checkpointing
from voxdiff.preflight import compiled
from voxdiff.preflight.compiled import CompiledTraceError, compiled_profile
from voxdiff.preflight.memory import predict_step_memory
from voxdiff.step import SEED, OptimSettings

# the step of the H100 measurements of compiled models (reference compiled rows): fused AdamW, gradients freed
# right after the optimizer step
FUSED_AFTER_STEP = dataclasses.replace(SEED, optim=OptimSettings(fused=True), zero_grad_at="after_step")


@pytest.fixture(scope="module", autouse=True)
def module_cache(tmp_path_factory):
    """The tests of this module trace each model once between them (a profile cache of their own, on disk and in
    the process); a test that checks the cache itself empties it (:func:`private_cache`)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VOXDIFF_CACHE_DIR", str(tmp_path_factory.mktemp("compiled-cache")))
        mp.setattr(compiled, "_PROFILES", {})
        yield


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    """An empty profile cache, on disk and in the process."""
    monkeypatch.setenv("VOXDIFF_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(compiled, "_PROFILES", {})


class _Tiny(nn.Module):
    """MONAI's resnet block (GroupNorm, SiLU, convolutions, time embedding, 1x1 skip) and spatial attention (SDPA)
    between two convolutions: the kernels of a diffusion UNet, few enough to compile on a CPU in seconds."""

    def __init__(self) -> None:
        super().__init__()
        self.conv_in = nn.Conv3d(2, 8, 3, padding=1)
        self.temb = nn.Linear(1, 16)
        self.block = DiffusionUNetResnetBlock(3, 8, 16, norm_num_groups=4, out_channels=16)
        self.attn = SpatialAttentionBlock(3, 16, num_head_channels=8, norm_num_groups=4, use_flash_attention=True)
        self.conv_out = nn.Conv3d(16, 1, 3, padding=1)

    def forward(self, x: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:  # (B, 2, d, h, w), (B,)
        emb = self.temb(timesteps.float()[:, None])
        return self.conv_out(F.silu(self.attn(self.block(self.conv_in(x), emb))))


SHAPE = (1, 2, 16, 16, 16)
INPUTS = [(SHAPE, torch.float32), ((1,), torch.int64)]


def test_plan_matches_a_real_inductor_compile_on_the_cpu(tmp_path, monkeypatch) -> None:
    """torch.compile (inductor) on the CPU, fp32, measured by the CPU allocator's events; the plan with inductor's
    CPU rules. ~15 s, most of it gcc: vectorised kernels are off (they change the code, not the buffers), the
    inductor cache is a fresh folder (a cold compile, as on a new machine), layout optimisation is off as inductor
    turns it off on the GPU for a UNet (its channels-last copies are not modelled)."""
    import torch._inductor.config as inductor_config

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    torch.manual_seed(0)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with inductor_config.patch({"layout_optimization": False, "compile_threads": 1, "cpp.vec_isa_ok": False}):
            model = _Tiny()
            step = torch.compile(model)
            x, t = torch.randn(SHAPE), torch.randint(0, 1000, (1,))
            out = step(x, t)  # compiles forward and backward
            grad = torch.randn_like(out)
            out.backward(grad)
            model.zero_grad(set_to_none=True)
            del out
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                out = step(x, t)
                with record_function("backward"):
                    out.backward(grad)
            with torch.device("meta"):
                meta = _Tiny()
            plan = compiled_profile(meta, INPUTS, None, device="cpu")
    finally:
        torch.set_num_threads(n)
    (fw_peak, fw_end), (bw_peak, bw_end) = phase_peaks(prof, "backward")
    forward, backward = plan.forward, plan.backward
    saved = sum(forward.sizes[b] for b in set(forward.outputs) if b in forward.sizes)
    grads = sum(backward.sizes[b] for b in set(backward.outputs) if b in backward.sizes)
    # what the forward leaves for the backward: the output and the tensors the partitioner saved (exact here)
    assert saved == pytest.approx(fw_end, rel=0.01)
    # the forward's peak: the real one also holds a contiguous copy of the last convolution's input next to the
    # channels-last attention output that is saved (256 KiB on 2.9 MiB here), which the plan does not model
    assert forward.peak <= fw_peak and forward.peak == pytest.approx(fw_peak, rel=0.10)
    # the backward: saved tensors freed at their last use, gradients kept, buffers in between
    assert backward.peak - backward.start == pytest.approx(bw_peak, rel=0.03)
    assert grads - backward.start == pytest.approx(bw_end, rel=0.02)


def _unet(**kw) -> nn.Module:
    args = dict(spatial_dims=3, in_channels=2, out_channels=1, channels=(16, 32), attention_levels=(0, 1),
                num_res_blocks=1, num_head_channels=16, norm_num_groups=8, use_flash_attention=True)
    args.update(kw)
    return DiffusionModelUNet(**args)


def test_compiled_step_holds_less_than_the_eager_one() -> None:
    shape = (1, 2, 16, 16, 16)
    eager = predict_step_memory(_unet, shape, FUSED_AFTER_STEP, attention="flash")
    comp = predict_step_memory(_unet, shape, FUSED_AFTER_STEP, attention="flash", compile=True)
    assert (eager.model_step, comp.model_step) == ("eager", "compiled")
    assert "compiled" in comp.summary() and "compiled" in comp.attention_path
    # fused pointwise chains keep nothing: under bf16 autocast the eager step keeps fp32 norm inputs, fp32 SiLU
    # inputs and bf16 conv inputs per resnet block, the compiled one fewer (the measured H100 rows: 10-50 % less)
    # (the forward's bytes above the optimizer phase's, which holds the same weights, AdamW state and workspaces
    # in both steps)
    held = eager.steady_step.optimizer
    assert comp.steady_step.optimizer == held
    assert comp.steady_step.forward - held < 0.9 * (eager.steady_step.forward - held)
    assert comp.steady_step.peak < eager.steady_step.peak
    # the rest of the step is the same: weights, and optimizer.step() of step 1 (weights, gradients, AdamW state)
    assert comp.param_bytes == eager.param_bytes
    assert comp.first_step.optimizer == eager.first_step.optimizer
    # CUDA graphs (mode="reduce-overhead"): the default mode's tensors, said so; their private pool as a second
    # allocator pool, whose segments the verdict counts where they exceed the allocated peak
    graphs = predict_step_memory(_unet, shape, FUSED_AFTER_STEP, attention="flash", compile=True,
                                 compile_mode="reduce-overhead")
    assert graphs.steady_step == comp.steady_step and graphs.peak_allocated == comp.peak_allocated
    assert any("reduce-overhead" in n and "default mode" in n and "pool" in n for n in graphs.notes)
    assert graphs.cuda_graphs and not comp.cuda_graphs
    assert graphs.estimated_reserved >= comp.estimated_reserved  # two pools share no segment
    budgeted = graphs.estimated_reserved + graphs.graph_pool_needed - graphs.graph_pool_bytes
    assert graphs.peak_needed == max(graphs.peak_allocated, budgeted) and budgeted > graphs.estimated_reserved
    assert comp.peak_needed == comp.peak_allocated


def test_fused_pointwise_chain_allocates_only_what_an_extern_kernel_reads() -> None:
    """x → ×2 → +1 → sin → conv: inductor computes the chain in the kernel that writes the convolution's input;
    the three intermediates are never in memory."""
    conv = nn.Conv3d(4, 4, 3, padding=1, bias=False, device="meta")

    class Chain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = conv

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.conv(torch.sin(x * 2 + 1))

    act = 4 * 8 * 8 * 8 * 4  # bytes of one fp32 activation (1, 4, 8, 8, 8)
    prof = compiled_profile(Chain(), [((1, 4, 8, 8, 8), torch.float32)], None)
    allocations = [b for sign, _, b in prof.forward.events if sign > 0]
    # the sine's result (the conv's input, saved for the weight gradient) and the conv's output: 2 buffers
    assert sorted(allocations) == [act, act]


def test_a_model_that_cannot_be_traced_is_predicted_eager_and_said_so() -> None:
    def build():
        m = _unet()
        apply_gradient_checkpointing(m, "layer", preserve_rng_state=False)
        return m

    shape = (1, 2, 16, 16, 16)
    eager = predict_step_memory(build, shape, FUSED_AFTER_STEP, attention="flash")
    fallback = predict_step_memory(build, shape, FUSED_AFTER_STEP, attention="flash", compile=True)
    assert fallback.model_step == "upper bound (eager)"
    assert any("upper bound" in n and "gradient checkpointing" in n for n in fallback.notes)
    assert "upper bound (eager)" in fallback.summary()
    assert (fallback.first_step, fallback.steady_step) == (eager.first_step, eager.steady_step)


def test_trace_failure_names_its_cause() -> None:
    with torch.device("meta"):
        m = _unet()
    apply_gradient_checkpointing(m, "block", preserve_rng_state=False)
    with pytest.raises(CompiledTraceError, match="gradient checkpointing"):
        compiled_profile(m, [((1, 2, 16, 16, 16), torch.float32), ((1,), torch.int64)], torch.bfloat16)


def test_profiles_are_read_back_from_the_cache(private_cache, monkeypatch) -> None:
    with torch.device("meta"):
        model = _Tiny()
    first = compiled_profile(model, INPUTS, torch.bfloat16)
    monkeypatch.setattr(compiled, "_PROFILES", {})  # a new process: only the disk cache is left

    def no_trace(*args, **kwargs):
        raise AssertionError("traced again")

    monkeypatch.setattr(compiled, "trace_compiled", no_trace)
    again = compiled_profile(model, INPUTS, torch.bfloat16)
    assert again == first
    with pytest.raises(AssertionError, match="traced again"):  # another precision is another profile
        compiled_profile(model, INPUTS, None)


def test_a_setting_that_repr_does_not_show_is_another_profile() -> None:
    """MONAI's attention flag is an attribute, not in the module's repr: flash and materialised attention must not
    share a cached profile."""
    shape = (1, 2, 16, 16, 16)  # the flash profile is that of the tests above (the module's cache)
    mat = predict_step_memory(lambda: _unet(use_flash_attention=False), shape, FUSED_AFTER_STEP, compile=True)
    fla = predict_step_memory(_unet, shape, FUSED_AFTER_STEP, attention="flash", compile=True)
    assert "materialised" in mat.attention_path and "flash" in fla.attention_path
    assert fla.steady_step.peak < mat.steady_step.peak


def test_a_ddp_rank_is_traced_compiled_an_fsdp_rank_eager_and_said_so() -> None:
    """DDP wraps the compiled model as it wraps the eager one: its buckets come on top of the compiled step.
    FSDP's compiled units run between its hooks, graphs the plan does not cover: the eager rank, an upper bound."""
    from voxdiff.run.spec import Parallel

    shape = (1, 2, 16, 16, 16)

    def rank(compile: bool, parallel: Parallel | None = None):
        return predict_step_memory(_unet, shape, FUSED_AFTER_STEP, attention="flash", compile=compile,
                                   parallel=parallel)

    one, one_eager = rank(True), rank(False)
    ddp, ddp_eager = rank(True, Parallel("ddp", 2)), rank(False, Parallel("ddp", 2))
    assert (ddp.model_step, ddp_eager.model_step) == ("compiled", "eager") and ddp.parallel.startswith("ddp×2")
    assert ddp.peak_allocated - one.peak_allocated == ddp_eager.peak_allocated - one_eager.peak_allocated > 0
    assert ddp.peak_allocated < ddp_eager.peak_allocated
    fsdp, fsdp_eager = rank(True, Parallel("fsdp", 2)), rank(False, Parallel("fsdp", 2))
    assert fsdp.model_step == "upper bound (eager)" and any("FSDP" in n for n in fsdp.notes)
    assert (fsdp.first_step, fsdp.steady_step) == (fsdp_eager.first_step, fsdp_eager.steady_step)
