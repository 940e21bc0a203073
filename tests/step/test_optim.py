"""The optimizer factory of the training step, its implementation choice, and the warm-up + cosine schedule."""

import math

import pytest
import torch
from voxdiff.errors import ConfigError
from voxdiff.step import (
    WarmupCosine,
    build_lr_scheduler,
    build_optimizer,
    optim_settings,
    optimizer_impl,
    params_device_type,
)
from voxdiff.step.optim import clip_gradients, folds_clip, unfold_clip


def _model():
    return torch.nn.Sequential(torch.nn.Conv3d(2, 4, 3), torch.nn.GroupNorm(2, 4))


def test_build_optimizer_settings_and_groups():
    m = _model()
    opt = build_optimizer(m.parameters(), {"lr": 3e-4, "betas": [0.8, 0.99], "weight_decay": 0.01, "eps": 1e-7})
    assert isinstance(opt, torch.optim.AdamW)
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.01 and no_decay["weight_decay"] == 0.0
    assert all(p.ndim >= 2 for p in decay["params"]) and all(p.ndim < 2 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(m.parameters()))
    assert decay["lr"] == 3e-4 and decay["betas"] == (0.8, 0.99) and decay["eps"] == 1e-7
    # no weight decay: one group (logged as plain "lr")
    assert len(build_optimizer(m.parameters(), {"lr": 1e-4}).param_groups) == 1


def test_build_optimizer_skips_frozen_parameters_and_passes_foreach():
    m = _model()
    m[1].requires_grad_(False)
    opt = build_optimizer(m.parameters(), {"foreach": False})
    assert sum(len(g["params"]) for g in opt.param_groups) == 2
    assert opt.defaults["foreach"] is False


@pytest.mark.parametrize(
    "cfg, key",
    [({"lr": 0}, "system.optim.lr"), ({"betas": [0.9]}, "system.optim.betas"),
     ({"warmup_steps": -1}, "system.optim.warmup_steps"), ({"min_lr_ratio": 2}, "system.optim.min_lr_ratio"),
     ({"momentum": 0.9}, "system.optim.momentum"), ({"foreach": True, "fused": True}, "system.optim.fused"),
     ({"decay_steps": 0}, "system.optim.decay_steps")],
)
def test_optim_settings_refuse_bad_values(cfg, key):
    with pytest.raises(ConfigError) as e:
        optim_settings(cfg)
    assert e.value.key == key


def test_warmup_cosine_closed_form():
    f = WarmupCosine(warmup_steps=10, decay_steps=110, min_lr_ratio=0.1)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(10) == pytest.approx(1.0)
    assert f(60) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert f(110) == pytest.approx(0.1) and f(10_000) == pytest.approx(0.1)
    assert WarmupCosine(0, 100, 0.0)(0) == pytest.approx(1.0)


def test_lr_scheduler_steps_per_call_and_round_trips():
    m = _model()
    s = optim_settings({"lr": 1.0, "warmup_steps": 2, "min_lr_ratio": 0.0})
    opt = build_optimizer(m.parameters(), s)
    sched = build_lr_scheduler(opt, s, total_steps=6)
    lrs = []
    for _ in range(7):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[:3] == pytest.approx([0.5, 1.0, 1.0]) and lrs[6] == pytest.approx(0.0, abs=1e-12)
    state = sched.state_dict()
    fresh = build_lr_scheduler(build_optimizer(m.parameters(), s), s, total_steps=999)
    fresh.load_state_dict(state)
    assert fresh.lr_lambdas[0].decay_steps == 6 and fresh.last_epoch == sched.last_epoch


@pytest.mark.parametrize(
    "cfg, device, impl",
    [({}, "cuda", "fused"), ({}, "cpu", "single"), ({}, "mixed", "single"), ({"foreach": True}, "cpu", "foreach"),
     ({"foreach": False}, "cuda", "single"), ({"fused": True}, "cuda", "fused"), ({"fused": True}, "cpu", "fused"),
     ({"fused": False}, "cuda", "foreach"), ({"fused": False}, "cpu", "single"),
     ({"foreach": True}, "cuda", "foreach")],
)
def test_implementation_follows_the_settings_then_fused_where_every_parameter_is_on_a_gpu(cfg, device, impl):
    """``system.optim.fused: null`` (and ``foreach: null``) means fused AdamW wherever every parameter is on a CUDA
    device; ``fused=false`` alone leaves torch's default (foreach on CUDA)."""
    assert optimizer_impl(optim_settings(cfg), device) == impl


def test_parameters_on_several_devices_are_not_fused():
    on_cpu, on_meta = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2, device="meta"))
    assert params_device_type([on_cpu, on_cpu]) == "cpu" and params_device_type([on_cpu, on_meta]) == "mixed"
    opt = build_optimizer([on_cpu, on_meta], {})
    assert not opt.defaults["fused"] and not opt.defaults["foreach"]  # "mixed": a loop over parameters


def test_fused_adamw_steps_on_the_cpu_like_the_loop():
    """The fused kernel (the GPU default) is also torch's on the CPU: same update as the loop, to float rounding."""
    torch.manual_seed(0)
    models = [_model(), _model()]
    models[1].load_state_dict(models[0].state_dict())
    opts = [build_optimizer(m.parameters(), {"lr": 1e-2}, impl) for m, impl in zip(models, ("fused", "single"))]
    assert opts[0].defaults["fused"]
    for _ in range(3):
        for m, opt in zip(models, opts):
            m(torch.ones(1, 2, 3, 3, 3)).square().sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    for a, b in zip(*(m.parameters() for m in models)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", ["foreach", "single", None])
def test_build_optimizer_makes_the_chosen_implementation(impl):
    opt = build_optimizer(_model().parameters(), {}, impl)
    want = impl or "single"  # None: torch's default for CPU parameters
    assert opt.defaults["foreach"] is (want == "foreach") and not opt.defaults["fused"]
    with pytest.raises(ValueError, match="impl"):
        build_optimizer(_model().parameters(), {}, "sgd")


def test_an_unbounded_run_needs_decay_steps():
    s = optim_settings({})
    with pytest.raises(ConfigError) as e:
        build_lr_scheduler(build_optimizer(_model().parameters(), s), s, total_steps=math.inf)
    assert e.value.key == "system.optim.decay_steps"
    bounded = optim_settings({"decay_steps": 10})
    assert build_lr_scheduler(build_optimizer(_model().parameters(), bounded), bounded, math.inf).lr_lambdas[0](10) \
        == pytest.approx(bounded.min_lr_ratio)


def _clip_run(fold: bool | None, steps: int = 3, value: float | None = 0.5):
    """Three AdamW steps of one small model on the same gradients: ``fold=True`` a fused AdamW given the clipping
    factor (``clip_gradients(..., optimizer=)``), ``False`` a fused AdamW after clipping in place, ``None`` no
    clipping. ``eps`` is large so that the update depends on the gradients' scale (Adam's is nearly scale-free)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=0.1, fused=True)
    g = torch.Generator().manual_seed(1)
    seen = []
    for _ in range(steps):
        (model(torch.randn(5, 8, generator=g)) ** 2).sum().mul(100).backward()
        raw = [p.grad.clone() for p in model.parameters()]
        if fold is not None:
            norm = clip_gradients(list(model.parameters()), value, "norm", optimizer=opt if fold else None)
            assert float(norm) == pytest.approx(float(torch.linalg.vector_norm(torch.stack([r.norm() for r in raw]))))
        seen.append((raw, [p.grad.clone() for p in model.parameters()], getattr(opt, "grad_scale", None)))
        opt.step()
        unfold_clip(opt)
        opt.zero_grad(set_to_none=True)
    return model, seen


def test_a_fused_adamw_takes_the_clipping_factor_into_its_kernel():
    """Clipping by norm for a fused AdamW: the same weights as clipping the gradients in place, with the gradients
    left untouched (no pass of their own) and the factor, ``max(1, norm / value)``, given as the kernel's
    ``grad_scale`` for one step only."""
    folded, seen = _clip_run(fold=True)
    in_place, seen_in_place = _clip_run(fold=False)
    unclipped, _ = _clip_run(fold=None)
    for a, b, c in zip(folded.parameters(), in_place.parameters(), unclipped.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        assert (a - c).abs().max() > 1e-4  # clipping changed the update: the comparison above can fail
    for (raw, grads, scale), (raw_ip, grads_ip, _) in zip(seen, seen_in_place):
        assert all(torch.equal(r, g) for r, g in zip(raw, grads))  # not clipped in place
        norm = torch.linalg.vector_norm(torch.stack([r.norm() for r in raw]))
        assert scale is not None and float(scale) == pytest.approx(max(1.0, float(norm) / 0.5), rel=1e-5)
        assert not all(torch.equal(r, g) for r, g in zip(raw_ip, grads_ip))  # the other path did clip
    assert not hasattr(folded, "grad_scale")


def test_only_a_fused_adamw_folds_the_clipping():
    model = torch.nn.Linear(4, 4)
    model(torch.randn(2, 4)).pow(2).sum().mul(100).backward()
    foreach = torch.optim.AdamW(model.parameters(), foreach=True)
    assert folds_clip(torch.optim.AdamW(model.parameters(), fused=True)) and not folds_clip(foreach)
    norm = clip_gradients(list(model.parameters()), 1e-3, "norm", optimizer=foreach)
    assert float(norm) > 1e-3 and not hasattr(foreach, "grad_scale")
    clipped = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    assert float(clipped) == pytest.approx(1e-3, rel=1e-3)  # clipped in place instead
