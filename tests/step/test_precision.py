"""One precision decision: the Trainer, the preflight and the sampler pick the same precision for the same config
on the same device (trainer.precision: null = bf16-mixed on a bf16 GPU, 16-mixed on an older GPU, 32-true on the
CPU), and all refuse what none of them can run."""

from __future__ import annotations

import shutil

import pytest
import torch

from voxdiff.config import compose
from voxdiff.errors import ConfigError
from voxdiff.lightning import resolve_precision
from voxdiff.preflight.memory import predict_memory
from voxdiff.step import Precision, decide_precision

FIXTURE = "tests/fixtures/pre_step_tiny.ckpt"


@pytest.fixture
def old_gpu(monkeypatch):
    """A CUDA machine whose GPU has no bf16 (e.g. a V100), as far as torch's queries tell."""
    from types import SimpleNamespace

    v100 = SimpleNamespace(name="Tesla V100-SXM2-32GB", total_memory=32 * 2**30, major=7, minor=0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: v100)  # the preflight's local GPU


def test_trainer_and_preflight_agree_on_a_gpu_without_bf16(tiny_cfg, old_gpu):
    cfg = tiny_cfg("trainer.precision=null", "trainer.accelerator=auto")
    trained = resolve_precision(None, "auto")
    assert trained == "16-mixed"
    assert predict_memory(cfg).precision == trained


def test_a_precision_the_preflight_cannot_model_is_refused_by_the_trainer_too(tiny_cfg):
    with pytest.raises(ConfigError, match="trainer.precision"):
        predict_memory(tiny_cfg("trainer.precision=bf16-true"))
    with pytest.raises(ConfigError, match="trainer.precision"):
        resolve_precision("bf16-true", "gpu")


@pytest.mark.parametrize(
    "requested, device, bf16, want",
    [(None, "cpu", None, "32-true"), (None, "cuda", True, "bf16-mixed"), (None, "cuda", False, "16-mixed"),
     ("32", "cuda", True, "32-true"), (32, "cpu", None, "32-true"), ("bf16", "cpu", None, "bf16-mixed"),
     ("16-mixed", "cuda", False, "16-mixed"), (16, "cuda", True, "16-mixed")],
)
def test_decide_precision(requested, device, bf16, want):
    assert decide_precision(requested, device, bf16) == Precision(want, device)


@pytest.mark.parametrize("requested, device, bf16", [("bf16-mixed", "cuda", False), ("16-mixed", "cpu", None),
                                                     ("64-true", "cpu", None), ("transformer-engine", "cuda", True)])
def test_precisions_that_cannot_run_are_refused_with_a_fix(requested, device, bf16):
    with pytest.raises(ConfigError, match=r"trainer\.precision=.*Fix: ") as e:
        decide_precision(requested, device, bf16)
    assert e.value.key == "trainer.precision"


def test_the_autocast_of_a_decision():
    with Precision("32-true", "cpu").autocast():
        assert not torch.is_autocast_enabled("cpu")
    with Precision("bf16-mixed", "cpu").autocast():
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    assert Precision("16-mixed", "cuda").scales_loss and not Precision("bf16-mixed", "cuda").scales_loss


@pytest.mark.parametrize("trained, override, want", [("bf16-mixed", None, (True, torch.bfloat16)),
                                                     ("bf16-mixed", "32-true", (False, None)),
                                                     ("16-mixed", None, "precision")])
def test_the_sampler_uses_the_trained_precision(repo, tmp_path, monkeypatch, trained, override, want):
    """A run trained with ``trainer.precision=bf16-mixed`` samples under the same autocast on this device (unless
    ``precision=`` says otherwise); a trained precision this device cannot run is refused with a fix."""
    ckpt = torch.load(repo / FIXTURE, map_location="cpu", weights_only=False)
    ckpt["voxdiff_config"]["trainer"]["precision"] = trained
    path = tmp_path / "trained.ckpt"
    torch.save(ckpt, path)
    from voxdiff.cli.sample import sample, validate
    from voxdiff.lightning.diffusion import DiffusionSystem

    seen = []
    generate = DiffusionSystem.generate

    def spy(self, *args, **kwargs):
        on = torch.is_autocast_enabled("cpu")
        seen.append((on, torch.get_autocast_dtype("cpu") if on else None))
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(DiffusionSystem, "generate", spy)
    cfg = compose("sample", [f"ckpt_path={path}", f"paths.output_dir={tmp_path / 'out'}", "n=1", "device=cpu",
                             "num_inference_steps=2", f"precision={override or 'null'}"])
    validate(cfg)
    if want == "precision":
        with pytest.raises(ConfigError) as e:
            sample(cfg)
        assert e.value.key == "precision" and "32-true" in e.value.fix
        return
    sample(cfg)
    assert seen == [want]
    shutil.rmtree(tmp_path / "out")
