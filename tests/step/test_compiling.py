"""``model.compile``: the compiled training step computes what the eager one does and keeps the model's own
state-dict keys (the Lightning side — EMA, validation, sampling, resume, a compiler failure — is in
``tests/lightning/test_diffusion.py``).

Inductor on this CPU compiles C++ kernels with gcc: its test took 90 s on a cold cache (2 cores, with other jobs
running), 6-10 s once inductor's FX graph cache holds its kernels. It is used here only, with vectorisation off
(scalar C++ kernels, which gcc compiles faster); the other compiled tests use the ``aot_eager`` backend (dynamo and
AOTAutograd, no code generation).
"""

from __future__ import annotations

import logging

import torch

from voxdiff.models import unet_spec
from voxdiff.models.unet import build_unet_from_spec
from voxdiff.step import CompileSettings, TrainStep, system_recipe

STEPS = 3


def _step(compile: CompileSettings | None, checkpointing: str = "none", channels_last: bool = False) -> TrainStep:
    torch.manual_seed(0)
    spec = unet_spec(4, 2, [8, 8], [False, True], [1, 1], 8, 4, use_flash_attention=True,
                     gradient_checkpointing=checkpointing, channels_last=channels_last)
    model = build_unet_from_spec(spec)
    for p in model.parameters():  # MONAI zero-initialises output convs: perturb so that every path carries signal
        p.data.add_(0.05 * torch.randn(p.shape))  # (randn_like would draw a channels-last weight in another order)
    step = TrainStep(model, system_recipe({"lr": LR}, {"decay": 0.5}, {}), mode="bravo", compile=compile)
    step.configure_optimizer()
    return step


def _batches() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [{"image_z": torch.randn(1, 2, 8, 8, 8, generator=g), "mask_z": torch.randn(1, 2, 8, 8, 8, generator=g)}
            for _ in range(STEPS)]


def _train(step: TrainStep) -> list[float]:
    losses = []
    for i, batch in enumerate(_batches()):
        torch.manual_seed(100 + i)  # the same timesteps and noise on both sides
        losses.append(float(step.run(batch)["mse"]))
    return losses


ATOL = 1e-4  # AdamW divides by sqrt(v): float rounding of small gradients becomes ~1e-5 in the weights
LR = 1e-3


def _assert_close(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    if name.endswith("to_k.bias"):
        # the key bias shifts every score of a query by the same amount, which softmax ignores: its exact gradient
        # is 0, and AdamW turns the rounding noise in it into steps of about ±lr, of either sign
        assert float((got - want).abs().max()) <= 2 * LR * STEPS, name
    else:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=ATOL, msg=name)


def _assert_same_training(eager: TrainStep, compiled: TrainStep, losses: tuple[list[float], list[float]]) -> None:
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    initial = _step(None).model.state_dict()
    for name, want in eager.model.state_dict().items():
        _assert_close(name, compiled.model.state_dict()[name], want)
    assert max(float((w - initial[n]).abs().max()) for n, w in eager.model.state_dict().items()) > 10 * ATOL
    for name, want, got in zip(eager.ema.names, eager.ema.shadow, compiled.ema.shadow):
        _assert_close(name, got, want)


def test_inductor_compiled_channels_last_steps_with_checkpointing_agree_with_contiguous_eager_steps(caplog):
    """Three optimizer steps (fused loss, AdamW, EMA) compiled by inductor with the gradient-checkpointing policy
    (``layer``) and ``model.channels_last`` (channels-last weights and input, inductor told to lay the graph out
    channels-last) leave the same weights and EMA as three eager contiguous steps without either; the weights, their
    gradients, AdamW's moments and the EMA's copies stay channels-last, and the warm-up is logged as a phase. (One
    compile for both settings: inductor's C++ build is most of this test's time on a cold cache.)"""
    settings = CompileSettings(backend="inductor", configured="auto", channels_last=True)
    assert settings.compile_kwargs() == {"options": {"force_layout_optimization": True}}
    assert "channels-last" in settings.describe()
    eager = _step(None)
    compiled = _step(settings, checkpointing="layer", channels_last=True)
    losses = _train(eager)
    with caplog.at_level(logging.INFO, logger="voxdiff.step.compiling"), \
            torch._inductor.config.patch({"cpp.vec_isa_ok": False}):
        losses = (losses, _train(compiled))
    _assert_same_training(eager, compiled, losses)
    # only the training forward is compiled: the model stays the eager module, with its own state-dict keys
    assert compiled.train_model is compiled.compiled.module and compiled.compiled.module._orig_mod is compiled.model
    assert list(compiled.model.state_dict()) == list(eager.model.state_dict())
    assert eager.train_model is eager.model and eager.compiled is None
    assert compiled.compiled.seconds is not None and compiled.compiled.seconds > 0
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("compiling the training step (model.compile=auto, mode default, backend inductor")
               for m in messages), messages
    assert sum(m.startswith("compiled the training step in") for m in messages) == 1, messages
    layout = torch.channels_last_3d
    weights = [p for p in compiled.model.parameters() if p.dim() == 5]
    assert all(p.is_contiguous(memory_format=layout) for p in weights)
    assert any(not p.is_contiguous() for p in weights)  # (a 1x1x1 kernel is contiguous in both layouts)
    moments = [compiled.optimizer.state[p]["exp_avg"] for p in weights]
    assert all(m.is_contiguous(memory_format=layout) for m in moments)
    shadows = [s for s in compiled.ema.shadow if s.dim() == 5]
    assert shadows and all(s.is_contiguous(memory_format=layout) for s in shadows)
    # torch.compile takes a mode or options, not both: a CUDA-graph mode becomes its inductor options
    graphs = CompileSettings(mode="reduce-overhead", backend="inductor", channels_last=True)
    assert graphs.compile_kwargs() == {"options": {"triton.cudagraphs": True, "force_layout_optimization": True}}
    assert CompileSettings(mode="reduce-overhead").compile_kwargs() == {"mode": "reduce-overhead"}
    assert CompileSettings(backend="aot_eager", channels_last=True).compile_kwargs() == {}


def test_cuda_graph_modes_start_a_graph_tree_iteration_at_every_training_forward(monkeypatch) -> None:
    # with CUDA graphs (mode reduce-overhead) the previous step's replayed outputs are overwritten by the next
    # replay: each training forward must say a new iteration starts, else the graph trees record a new graph
    from voxdiff.step.compiling import CompiledForward

    marks = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    model = torch.nn.Linear(2, 2)
    graphs = CompiledForward(model, CompileSettings(mode="reduce-overhead", backend="inductor"))
    plain = CompiledForward(model, CompileSettings(mode=None, backend="inductor"))
    assert graphs.cudagraphs and not plain.cudagraphs
    for _ in range(3):
        graphs.start()
        plain.start()
    assert len(marks) == 3
