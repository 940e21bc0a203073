"""Samples drawn during training autoguide as the run's commands do (``system.sampling.autoguide_scale``) once the
run's guide snapshot is written (``DiffusionSystem.sampling_guide``), so the montages a run writes show what
``sample.py`` and ``evaluate.py`` of it draw."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import nibabel as nib
import numpy as np
import pytest
import torch

from voxdiff.checkpoint import guide_checkpoint_name
from voxdiff.cli.train import train
from voxdiff.config import compose
from voxdiff.lightning.callbacks import GuideSnapshot
from voxdiff.lightning.diffusion import DiffusionSystem

#: a tiny demo run of 3 steps whose guide snapshot is taken after step 1, sampling one mask at the end in 2 steps
#: (every step guided: the demo's [0, 0.2] holds neither of 2 steps), the EMA averaging from step 0
GUIDED = ["callbacks.guide.step=1", "trainer.max_steps=3", "system.sampling.final=true", "system.sampling.num_masks=1",
          "system.sampling.num_inference_steps=2", "system.sampling.guidance_interval=[0,1]", "system.ema.start_step=0"]


def _run(tiny_demo, out: Path, scale: float) -> Path:
    report = train(compose("train", [*tiny_demo, *GUIDED, f"system.sampling.autoguide_scale={scale}",
                                     f"paths.output_dir={out}"]))
    return Path(report["last_checkpoint"])


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_demo):
    """The same run (one seed: the same weights at every step) with the run's autoguidance at 1.5 and at 1 (none);
    the log of the guided one."""
    handler = _Records()
    logger = logging.getLogger("voxdiff.lightning.diffusion")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        guided = _run(tiny_demo, tmp_path_factory.mktemp("guided"), 1.5)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    plain = _run(tiny_demo, tmp_path_factory.mktemp("plain"), 1.0)
    return guided, plain, handler.messages


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _final(ckpt: Path) -> np.ndarray:
    files = sorted((ckpt.parent.parent / "samples").glob("final_step0000003_*_generated.nii.gz"))
    assert len(files) == 1, files
    return np.asarray(nib.load(files[0]).dataobj)


def test_the_final_samples_of_a_run_that_autoguides_are_drawn_with_its_guide_snapshot(runs):
    guided, plain, messages = runs
    snapshot = guided.parent / guide_checkpoint_name(1)
    assert snapshot.is_file()
    assert f"samples autoguided at scale 1.5 by {snapshot}" in messages
    weights = [torch.load(c, map_location="cpu", weights_only=True)["state_dict"] for c in (guided, plain)]
    assert all(torch.equal(v, weights[1][k]) for k, v in weights[0].items())  # autoguidance does not train
    a, b = _final(guided), _final(plain)
    assert a.shape == b.shape and np.abs(a - b).max() > 1e-3  # the same weights, masks and noise: the guide differs


def test_the_guide_is_the_snapshot_s_ema_weights_and_none_before_it(runs):
    guided, _, _ = runs
    system = DiffusionSystem.load_from_checkpoint(guided, weights_only=True, map_location="cpu")
    snapshot = GuideSnapshot(guided.parent, 1)
    system._trainer = SimpleNamespace(callbacks=[snapshot], global_step=3)
    rng = torch.get_rng_state()
    guide, scale = system.sampling_guide()
    assert torch.equal(torch.get_rng_state(), rng)  # nothing initialised: the training's random stream goes on as is
    assert scale == 1.5 and guide is not None and not any(p.requires_grad for p in guide.parameters())
    shadow = torch.load(snapshot.path, map_location="cpu", weights_only=True)["ema"]["shadow"]
    state = guide.state_dict()
    assert shadow and all(torch.equal(state[k], v) for k, v in shadow.items())
    raw = torch.load(snapshot.path, map_location="cpu", weights_only=True)["state_dict"]
    assert any(not torch.equal(state[k], raw[f"model.{k}"]) for k in shadow)  # the EMA's, not the raw weights
    last = system.model.state_dict()
    assert any(not torch.equal(state[k], last[k]) for k in shadow)  # the step-1 model, not the trained one
    weight = next(p for p in guide.parameters() if p.dim() == 5)
    assert not weight.is_contiguous(memory_format=torch.channels_last_3d)  # this CPU run's layout
    system.spec = replace(system.spec, channels_last=True)  # a channels-last model's guide keeps its layout
    weight = next(p for p in system.sampling_guide()[0].parameters() if p.dim() == 5)
    assert weight.is_contiguous(memory_format=torch.channels_last_3d)
    system._trainer = SimpleNamespace(callbacks=[snapshot], global_step=0)
    assert system.sampling_guide() == (None, 1.0)  # before the snapshot is taken
    system._trainer = SimpleNamespace(callbacks=[GuideSnapshot(guided.parent, None)], global_step=3)
    assert system.sampling_guide() == (None, 1.0)  # a run that takes none


def test_a_guide_is_refused_naming_the_file_when_it_is_another_model_or_damaged(runs, tmp_path):
    """``DiffusionSystem.load_guide`` (training's guide and ``sample.py``'s) refuses, naming ``autoguide_ckpt`` and the
    file: a snapshot that records another encoding with the same weight shapes (space-to-depth's 8 channels are
    Haar's), another mode, a weight of another shape, a non-finite weight, and a checkpoint of another kind; the
    snapshot as written loads, its EMA weights or its raw ones as asked."""
    from voxdiff.errors import ConfigError

    guided, _, _ = runs
    system = DiffusionSystem.load_from_checkpoint(guided, weights_only=True, map_location="cpu")
    path = guided.parent / guide_checkpoint_name(1)
    state = torch.load(path, map_location="cpu", weights_only=True)
    raw = {k[len("model."):]: v for k, v in state["state_dict"].items() if k.startswith("model.")}
    assert all(torch.equal(system.load_guide(path, use_ema=False).state_dict()[k], v) for k, v in raw.items())
    ema = system.load_guide(path, use_ema=True).state_dict()
    assert all(torch.equal(ema[k], v) for k, v in state["ema"]["shadow"].items())

    def tampered(name: str, change) -> Path:
        copy = torch.load(path, map_location="cpu", weights_only=True)
        change(copy)
        out = tmp_path / f"{name}.ckpt"
        torch.save(copy, out)
        return out

    weight = next(k for k, v in state["state_dict"].items() if k.startswith("model.") and v.dim() == 5)
    cases = {
        "encoding": (lambda c: c["hyper_parameters"].__setitem__(
            "encoding", {"_target_": "voxdiff.encodings.SpaceToDepth", "factor": 2}),
                     r"is another model: it records encoding "
                     r"\{'_target_': 'voxdiff.encodings.SpaceToDepth', 'factor': 2\}, "
                     r"where this one has \{'_target_': 'voxdiff.encodings.HaarWavelet'\}"),
        "mode": (lambda c: c["hyper_parameters"].__setitem__("mode", "seg"),
                 r"is another model: it records mode seg, where this one has bravo"),
        "shape": (lambda c: c["state_dict"].__setitem__(weight, torch.zeros(1, 1, 1, 1, 1)),
                  rf"has other weights than this model \(1 weights have other shapes \(checkpoint vs model\): {weight} "
                  r"\[1, 1, 1, 1, 1\] vs"),
        "nan": (lambda c: c["state_dict"][weight].fill_(float("nan")), rf"its weight state_dict.{weight} holds NaN"),
        "kind": (lambda c: c["hyper_parameters"].__setitem__("kind", "stage1"), r"is a VQ-VAE stage-1 checkpoint"),
    }
    for name, (change, message) in cases.items():
        bad = tampered(name, change)
        with pytest.raises(ConfigError, match=rf"autoguide_ckpt={bad}: {message}") as refused:
            system.load_guide(bad, use_ema=True)
        assert "Fix: use the guide snapshot of the same run" in str(refused.value), name


def test_a_mask_model_logs_the_lesions_of_the_masks_it_samples_in_training(tmp_path, tiny_demo):
    """A ``mode=seg`` run's final samples: their lesions and lesion voxels a mask, and the validation masks', in the
    run's CSV; the generated figures are those of the masks it wrote (counted again from the NIfTI files), the real
    ones the phantom's (1-4 lesions a mask)."""
    import csv

    from voxdiff.evaluation.lesions import lesion_table

    train(compose("train", [*tiny_demo, "mode=seg", "system.sampling.final=true", "system.sampling.num_masks=1",
                            "system.sampling.num_inference_steps=2", "system.sampling.autoguide_scale=1",
                            f"paths.output_dir={tmp_path}"]))
    rows = list(csv.DictReader(open(next(tmp_path.rglob("metrics.csv")))))
    (row,) = [r for r in rows if r.get("samples/lesions_per_mask")]
    written = sorted((tmp_path / "samples").glob("*_generated.nii.gz"))
    masks = torch.stack([torch.from_numpy(np.asarray(nib.load(p).dataobj, dtype=np.float32))[None] for p in written])
    drawn = lesion_table(masks)
    assert float(row["samples/lesions_per_mask"]) == pytest.approx(float(drawn.lesions.mean()))
    assert float(row["samples/lesion_voxels_per_mask"]) == pytest.approx(float(drawn.voxels.mean()))
    assert 1 <= float(row["samples/real_lesions_per_mask"]) <= 4
    assert float(row["samples/real_lesion_voxels_per_mask"]) > 0
